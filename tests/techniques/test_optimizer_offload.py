"""Optimizer offload changes where the state lives, never the math (bitwise oracles: the same
optimizer stepping the device parameters directly)."""

import copy
import io
import warnings

import pytest
import torch

import memfit
from memfit.measure import Tracker
from memfit.step import canonical_step, compute_loss
from memfit.techniques import _offloaded_optimizer
from memfit.techniques.optimizer_offload import OffloadedOptimizer, OptimizerOffload
from memfit.trace.fake import FakeCopier
from tests.helpers import tiny

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


@pytest.fixture(autouse=True)
def _quiet():
    # the once-per-process CPU warning is tested on its own
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="OptimizerOffload", category=UserWarning)
        yield


def _pair(name="gpt2", optimizer="adamw", **config):
    """Two identical models: one with the plain optimizer, one offloaded."""
    plain, batch = tiny(name)
    model, _ = tiny(name)
    opt = OPTIMIZERS[optimizer](plain.parameters())
    off = OptimizerOffload(OptimizerOffload.Config(**config)).apply(
        model, OPTIMIZERS[optimizer](model.parameters())).optimizer
    return (plain, opt), (model, off), batch


def _train(model, opt, batch, steps=3, before_step=None, scheduler=None):
    """``steps`` canonical steps, the RNG (dropout) seeded with the step number before each."""
    for k in range(steps):
        torch.manual_seed(k)
        opt.zero_grad(set_to_none=True)
        compute_loss(model, batch).backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _equal_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", ["gpt2", "bert-base"])
def test_three_steps_bitwise_equal(name, optimizer):
    (plain, opt), (model, off), batch = _pair(name, optimizer)
    _train(plain, opt, batch)
    _train(model, off, batch)
    assert _equal_params(plain, model)
    assert all(h.grad is None for h in off.host_params)          # host grads freed
    assert all(p.grad is not None for p in model.parameters())   # device grads untouched
    inner = {id(h) for g in off.inner.param_groups for h in g["params"]}
    assert inner == {id(h) for h in off.host_params}            # the inner steps the twins
    assert inner.isdisjoint(id(p) for p in model.parameters())


@pytest.mark.parametrize("chunk_bytes", [1, 64 * 1024])
def test_chunks_are_bitwise_equal_and_bound_the_host_gradients(chunk_bytes):
    (plain, opt), (model, off), batch = _pair(chunk_bytes=chunk_bytes)
    calls = []
    off.inner.register_step_post_hook(lambda *a: calls.append(1))
    _train(plain, opt, batch)
    _train(model, off, batch)
    assert _equal_params(plain, model)
    # one inner step per chunk: chunk_bytes=1 gives one parameter per chunk
    n = len(list(model.parameters()))
    assert (len(calls) == 3 * n) if chunk_bytes == 1 else (3 < len(calls) < 3 * n)


def test_chunking_lowers_the_host_peak_by_the_gradients_not_in_flight():
    peaks = {}
    for chunk in (None, 64 * 1024):
        _, (model, off), batch = _pair(chunk_bytes=chunk)
        _train(model, off, batch, steps=1)
        with Tracker(model, off, host_tensors=off.host_tensors()) as t:
            _train(model, off, batch, steps=1)
        peaks[chunk] = t.host_peak_bytes
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    # all host grads at once vs at most one chunk (or one larger parameter) of them; AdamW's
    # step temporaries are per parameter either way
    assert peaks[None] - peaks[64 * 1024] >= grad_bytes - max(64 * 1024, largest)


def test_gradient_accumulation_two_backwards_then_one_step():
    (plain, opt), (model, off), batch = _pair("gpt2", "adamw")
    halves = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]
    for m, o in ((plain, opt), (model, off)):
        for k in range(3):
            o.zero_grad(set_to_none=True)
            for j, half in enumerate(halves):
                torch.manual_seed(10 * k + j)
                (compute_loss(m, half) / 2).backward()   # grads accumulate on the device
            o.step()
    assert _equal_params(plain, model)


def test_clip_grad_norm_before_step():
    clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)   # noqa: E731
    (plain, opt), (model, off), batch = _pair("gpt2", "adamw")
    _train(plain, opt, batch, before_step=clip)
    _train(model, off, batch, before_step=clip)
    assert _equal_params(plain, model)


def _scaled_train(model, opt, batch, steps, inf_at=None):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for k in range(steps):
        torch.manual_seed(k)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = compute_loss(model, batch)
        scaler.scale(loss).backward()
        if k == inf_at:
            next(model.parameters()).grad[0] = float("inf")
        scaler.unscale_(opt)                     # on the device grads, before any copy
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return scaler


def test_grad_scaler_fp16_autocast_equals_the_plain_optimizer():
    (plain, opt), (model, off), batch = _pair("gpt2", "adamw")
    s1 = _scaled_train(plain, opt, batch, 3)
    s2 = _scaled_train(model, off, batch, 3)
    assert s1.get_scale() == s2.get_scale()
    assert _equal_params(plain, model)


def test_grad_scaler_skips_the_step_on_an_inf_grad():
    (plain, opt), (model, off), batch = _pair("gpt2", "adamw")
    before = [p.detach().clone() for p in model.parameters()]
    s1 = _scaled_train(plain, opt, batch, 1, inf_at=0)
    s2 = _scaled_train(model, off, batch, 1, inf_at=0)
    assert s1.get_scale() == s2.get_scale() == 2.0 ** 9      # backed off once
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert _equal_params(plain, model)
    assert len(off.inner.state) == 0 and len(off.state) == 0   # the inner step never ran


def test_lr_scheduler_reaches_the_inner_optimizer():
    (plain, opt), (model, off), batch = _pair("gpt2", "momentum")
    s1 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(off, step_size=1, gamma=0.5)
    _train(plain, opt, batch, scheduler=s1)
    _train(model, off, batch, scheduler=s2)
    assert _equal_params(plain, model)
    assert off.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    assert off.inner.param_groups[0]["lr"] == 0.1 * 0.5 ** 2   # synced at the last step
    off.zero_grad()
    off.step()                                                  # no grads: nothing moves,
    assert off.inner.param_groups[0]["lr"] == 0.1 * 0.5 ** 3   # but the inner group is synced


def _saved(state_dict):
    """Through a file, as a checkpoint would be (a live state dict shares its tensors)."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def test_state_dict_round_trip_and_plain_compatibility():
    (plain, opt), (model, off), batch = _pair("gpt2", "adamw")
    _train(plain, opt, batch, steps=2)
    _train(model, off, batch, steps=2)
    model2 = copy.deepcopy(model)
    off2 = OptimizerOffload(OptimizerOffload.Config()).apply(
        model2, OPTIMIZERS["adamw"](model2.parameters())).optimizer
    off2.load_state_dict(_saved(off.state_dict()))
    assert torch.equal(off2.state[next(model2.parameters())]["exp_avg"],
                       off.state[next(model.parameters())]["exp_avg"])
    plain2 = copy.deepcopy(plain)
    opt2 = OPTIMIZERS["adamw"](plain2.parameters())
    opt2.load_state_dict(_saved(off.state_dict()))   # torch's format: a plain optimizer loads it
    off3 = OptimizerOffload(OptimizerOffload.Config()).apply(plain, opt).optimizer  # copies state
    assert off3.state[next(plain.parameters())]["exp_avg"].untyped_storage().data_ptr() != \
        opt.state[next(plain.parameters())]["exp_avg"].untyped_storage().data_ptr()
    for m, o in ((plain2, opt2), (model, off), (model2, off2), (plain, off3)):
        torch.manual_seed(7)
        canonical_step(m, o, batch)
    assert _equal_params(plain2, model) and _equal_params(model, model2)
    assert _equal_params(model, plain)


def test_track_counts_the_state_on_the_host_not_the_device():
    (plain, opt), (model, off), batch = _pair("gpt2", "adamw")
    _train(plain, opt, batch, steps=1)       # steady state: the optimizer state exists
    _train(model, off, batch, steps=1)
    with memfit.track(plain, opt) as t_plain:
        canonical_step(plain, opt, batch)
    # state made before the region is named to the tracker (module Note 3)
    with Tracker(model, off, host_tensors=off.host_tensors()) as t_off:
        canonical_step(model, off, batch)
    params = list(model.parameters())
    param_bytes = sum(p.numel() * 4 for p in params)
    state_bytes = 2 * param_bytes + 4 * len(params)    # AdamW: exp_avg, exp_avg_sq, 4 B step
    assert t_plain.breakdown["optimizer"] == state_bytes
    assert t_off.breakdown["optimizer"] == 0
    # the host holds twins + state, and transiently the host grads
    assert t_off.host_peak_bytes >= param_bytes + state_bytes + param_bytes
    # the device peak (in the backward here) is the plain one less exactly the state
    assert t_off.breakdown == {**t_plain.breakdown, "optimizer": 0}
    assert t_plain.peak_bytes - t_off.peak_bytes == state_bytes


def test_first_step_under_track_creates_the_state_on_the_host():
    _, (model, off), batch = _pair("gpt2", "adamw")
    with memfit.track(model, off) as t:
        canonical_step(model, off, batch)
    params = list(model.parameters())
    assert t.breakdown["optimizer"] == 0
    assert t.host_peak_bytes >= 2 * sum(p.numel() * 4 for p in params) + 4 * len(params)


def test_a_fake_trace_matches_the_real_run_to_the_byte():
    _, (model, off), batch = _pair("gpt2", "adamw")
    copier = FakeCopier("cpu")
    fake_model, fake_batch = copier.module(model), copier.tree(batch)
    with copier.mode:
        fake_off = OptimizerOffload(OptimizerOffload.Config()).apply(
            fake_model, OPTIMIZERS["adamw"](fake_model.parameters())).optimizer
        canonical_step(fake_model, fake_off, fake_batch)
        with Tracker(fake_model, fake_off, host_tensors=fake_off.host_tensors(), fake=True) as fake:
            canonical_step(fake_model, fake_off, fake_batch)
    assert all(isinstance(t, torch._subclasses.FakeTensor) for t in fake_off.host_tensors())
    canonical_step(model, off, batch)
    with Tracker(model, off, host_tensors=off.host_tensors()) as real:
        canonical_step(model, off, batch)
    assert (fake.peak_bytes, fake.host_peak_bytes) == (real.peak_bytes, real.host_peak_bytes)
    assert fake.breakdown == real.breakdown


def test_injected_copies_are_used_once_per_parameter_with_a_grad():
    calls = {"host": 0, "device": 0}

    def counted(kind):
        def copy_(dst, src):
            calls[kind] += 1
            dst.copy_(src)
        return copy_

    plain, batch = tiny("gpt2")
    model, _ = tiny("gpt2")
    tech = OptimizerOffload(OptimizerOffload.Config(), copy_to_host=counted("host"),
                            copy_to_device=counted("device"))
    off = tech.apply(model, OPTIMIZERS["sgd"]).optimizer           # a factory
    opt = OPTIMIZERS["sgd"](plain.parameters())
    _train(plain, opt, batch, steps=2)
    _train(model, off, batch, steps=2)
    n = sum(p.grad is not None for p in model.parameters())
    assert calls == {"host": 2 * n, "device": 2 * n}
    assert _equal_params(plain, model)


def test_warns_once_per_process_on_the_cpu(monkeypatch):
    monkeypatch.setattr(_offloaded_optimizer, "_warned_unpinned", False)
    model, _ = tiny("gpt2")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            OptimizerOffload(OptimizerOffload.Config()).apply(
                model, OPTIMIZERS["sgd"](model.parameters()))
    assert [str(w.message).split(":")[0] for w in seen] == ["OptimizerOffload"]
    assert "not pinned" in str(seen[0].message)


def test_fakes_do_not_warn(monkeypatch):
    monkeypatch.setattr(_offloaded_optimizer, "_warned_unpinned", False)
    model, _ = tiny("gpt2")
    copier = FakeCopier("cpu")
    fake_model = copier.module(model)
    with warnings.catch_warnings(record=True) as seen, copier.mode:
        warnings.simplefilter("always")
        OptimizerOffload(OptimizerOffload.Config()).apply(
            fake_model, OPTIMIZERS["sgd"](fake_model.parameters()))
    assert not [w for w in seen if "OptimizerOffload" in str(w.message)]


def test_config_and_apply_errors():
    with pytest.raises(ValueError, match="chunk_bytes"):
        OptimizerOffload.Config(chunk_bytes=0)
    model, _ = tiny("gpt2")
    opt = OPTIMIZERS["sgd"](model.parameters())
    off = OptimizerOffload(OptimizerOffload.Config(enabled=False)).apply(model, opt)
    assert off.optimizer is opt and not off.optimizer_rebuilt and off.notes == ()
    tech = OptimizerOffload(OptimizerOffload.Config())
    with pytest.raises(ValueError, match="already offloaded"):
        tech.apply(model, tech.apply(model, opt).optimizer)
    with pytest.raises(ValueError, match="Optimizer"):
        tech.apply(model, "adamw")
    change = tech.apply(model, opt)
    off = change.optimizer
    assert change.optimizer_rebuilt and change.model is model and change.modes == {}
    assert isinstance(off, OffloadedOptimizer) and isinstance(off, torch.optim.Optimizer)
    with pytest.raises(NotImplementedError):
        off.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


@pytest.mark.requires_gpu
def test_cuda_twins_are_pinned_and_follow_the_plain_optimizer():
    plain, batch = tiny("gpt2")
    model, _ = tiny("gpt2")
    plain.cuda()
    model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    opt = OPTIMIZERS["adamw"](plain.parameters())
    off = OptimizerOffload(OptimizerOffload.Config(chunk_bytes=64 * 1024)).apply(
        model, OPTIMIZERS["adamw"](model.parameters())).optimizer
    assert all(h.is_pinned() and h.device.type == "cpu" for h in off.host_params)
    _train(plain, opt, batch)
    _train(model, off, batch)
    assert all(v.device.type == "cpu" for v in off.host_tensors())
    for p, q in zip(plain.parameters(), model.parameters()):    # CUDA vs CPU AdamW kernels
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
