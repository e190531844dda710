"""Gradients offloaded to the host as backward produces them (``offload_gradients``,
optimizer_offload Note 5; torchao's ``CPUOffloadOptimizer(offload_gradients=True)``).

Oracles, none of them memfit's counter: the plain optimizer stepping the device parameters
(``torch.equal`` on every parameter after 3 steps, AdamW ``foreach=False``, fp32); ``LiveBytes``
(tests/live_bytes.py) over a real CPU step with the technique applied by hand, device and host
bytes apart, against ``memfit.estimate``; the gradient bytes by hand (4 bytes per fp32 value)."""

import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.step import compute_loss
from memfit.techniques.optimizer_offload import OptimizerOffload
from tests.helpers import tiny
from tests.live_bytes import LiveBytes, alive_storages, job_tensors

ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)      # noqa: E731


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():          # optimizer offload's once-per-process CPU warning
        warnings.filterwarnings("ignore", message="OptimizerOffload", category=UserWarning)
        yield


def _offloaded(model, offload_gradients: bool):
    return OptimizerOffload(OptimizerOffload.Config(offload_gradients=offload_gradients)).apply(
        model, ADAMW(model.parameters()))


def _train(model, opt, batch, steps=3, halves=1):
    """``steps`` steps of ``halves`` backwards each, the RNG (dropout) seeded before each."""
    parts = [{k: v[i::halves] for k, v in batch.items()} for i in range(halves)]
    for k in range(steps):
        opt.zero_grad(set_to_none=True)
        for j, part in enumerate(parts):
            torch.manual_seed(10 * k + j)
            (compute_loss(model, part) / halves).backward()
        opt.step()


def _equal(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("offload_gradients", [False, True])
def test_three_steps_bitwise_equal_to_the_plain_step(offload_gradients, halves):
    """Two halves: the second backward's gradients are added to the first's on the host (torchao
    overwrites them); with fp32 gradients the same sum the device's accumulation makes."""
    plain, batch = tiny("gpt2")
    model, _ = tiny("gpt2")
    opt = ADAMW(plain.parameters())
    change = _offloaded(model, offload_gradients)
    _train(plain, opt, batch, halves=halves)
    _train(model, change.optimizer, batch, halves=halves)
    assert _equal(plain, model)
    on_device = [p.grad is not None for p in model.parameters()]
    assert not any(on_device) if offload_gradients else all(on_device)
    hosted = [h.grad is not None for h in change.optimizer.host_params]
    assert all(hosted) if offload_gradients else not any(hosted)
    change.remove()                  # the hooks off: the step copies device gradients again
    _train(plain, opt, batch, steps=1)
    _train(model, change.optimizer, batch, steps=1)
    assert _equal(plain, model) and all(p.grad is not None for p in model.parameters())


def test_clipping_reads_the_host_gradients_bitwise():
    """``max_grad_norm`` through memfit's Runner: the norm of the host gradients clips them, as
    the plain runner clips the device ones (same norm, same parameters, bitwise)."""
    (a, batch), (b, _) = tiny("gpt2"), tiny("gpt2")
    knobs = dict(max_grad_norm=1e-3, micro_batch_size=2)
    ra = memfit.fit(memfit.Job(a, batch, optimizer=ADAMW(a.parameters())), **knobs)
    rb = memfit.fit(memfit.Job(b, batch, optimizer=ADAMW(b.parameters())),
                    offload_optimizer=True, offload_gradients=True, **knobs)
    for k in range(3):
        torch.manual_seed(k)
        ra.step(batch)
        torch.manual_seed(k)
        rb.step(batch)
        assert ra.last_step.grad_norm == rb.last_step.grad_norm
    assert _equal(a, b)
    ra.close()
    rb.close()


def _mlp():
    """Two 256 x 256 layers at batch 2: the weights and gradients dominate the step."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), \
        (torch.randn(2, 256), torch.randn(2, 256))


def _live(make, offload_gradients: bool, loss_fn=None, **knobs):
    """A real CPU step through memfit's Runner (the third effective batch), counted by
    LiveBytes, device and host apart; and the estimate of the same step."""
    before = alive_storages()
    model, batch = make()
    model.eval()                                    # no dropout: nothing drawn
    job = memfit.Job(model, batch, optimizer=ADAMW, loss_fn=loss_fn)
    est = memfit.estimate(job, offload_optimizer=True, offload_gradients=offload_gradients,
                          **knobs)
    runner = memfit.fit(job, offload_optimizer=True, offload_gradients=offload_gradients,
                        **knobs)
    for _ in range(2):
        runner.step(batch)
    prepared = runner.prepare(batch)     # as the step uses it: an all-ones mask dropped,
    del job, batch                       # which the caller's batch would keep alive here
    # the host tensors (last step's gradients among them) named, no reference kept
    with LiveBytes(host_tensors=runner.optimizer.host_tensors(),
                   device_tensors=job_tensors(before)) as live:
        runner.run(prepared)
    runner.close()
    assert (est.peak_bytes, est.host_peak_bytes) == (live.peak_bytes, live.host_peak_bytes)
    return live, est


def test_estimate_is_a_real_step_on_the_device_and_on_the_host():
    """GPT-2 (tiny), one micro-batch: device and host bytes apart, each to the byte."""
    _live(lambda: tiny("gpt2"), True)


# 8 s: the CI time limit; micro-batches stay in the default tier, bitwise
# (test_three_steps_bitwise_equal_to_the_plain_step with halves=2)
@pytest.mark.slow
def test_micro_batches_on_the_host_and_the_peak_drop():
    """An MLP whose weights dominate (two 256 x 256 layers, batch 2), to the byte with and
    without the hooks, in one micro-batch and in two. Without them the peak holds every
    gradient (526,336 B: 4 bytes a value, by hand); with them, only the last layer's, which
    backward has just made (263,168 B); the rest of the step (the batch's activations and
    temporaries, 4,096 B here) moves the peak little: it drops by 259,072 B."""
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])       # noqa: E731
    model, _ = _mlp()
    grads = sum(4 * p.numel() for p in model.parameters())
    layer = 4 * (256 * 256 + 256)
    plain, est0 = _live(_mlp, False, loss)
    hooked, est = _live(_mlp, True, loss)
    assert est0.breakdown["grads"] == grads and est.breakdown["grads"] == layer
    drop = plain.peak_bytes - hooked.peak_bytes
    assert grads - layer - 2 * 2 * 256 * 4 <= drop < grads - layer
    _live(_mlp, True, loss, micro_batch_size=1)       # the second adds on the host


@pytest.mark.parametrize("knobs,match", [
    ({}, "needs offload_optimizer=True"),
    ({"offload_optimizer": True, "precision": "fp16"}, "precision='fp16'.*GradScaler"),
    ({"offload_optimizer": True, "offload_params": "all"}, "offload_params"),
])
def test_what_cannot_run_is_refused_with_the_fix(knobs, match):
    model, batch = _mlp()
    loss = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])       # noqa: E731
    job = memfit.Job(model, batch, optimizer=ADAMW, loss_fn=loss)
    with pytest.raises(ValueError, match=match):
        memfit.estimate(job, device="rtx-4090" if "precision" in knobs else None,
                        offload_gradients=True, **knobs)
    step = lambda m, b, o: (o.zero_grad(), loss(m, b).backward(), o.step())   # noqa: E731
    with pytest.raises(ValueError, match="step=fn"):
        memfit.estimate(memfit.Job(model, batch, optimizer=ADAMW, step=step),
                        offload_optimizer=True, offload_gradients=True)
    with pytest.raises(ValueError, match="chunk_bytes"):
        OptimizerOffload.Config(offload_gradients=True, chunk_bytes=1 << 20)


def test_torchaos_cpu_offload_optimizer_is_refused_with_memfits_equivalent():
    """torchao's ``CPUOffloadOptimizer`` builds only on CUDA or XPU (its constructor asserts
    so), so the instance here is made without its constructor: what memfit reads first is its
    class, and the answer names the knobs that do the same."""
    cpu_offload = pytest.importorskip("torchao.optim.cpu_offload")
    model, batch = _mlp()
    opt = cpu_offload.CPUOffloadOptimizer.__new__(cpu_offload.CPUOffloadOptimizer)
    with pytest.raises(ValueError, match="CPUOffloadOptimizer.*offload_optimizer=True.*"
                                         "offload_gradients=True"):
        memfit.estimate(memfit.Job(model, batch, optimizer=opt,
                                   loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])))
