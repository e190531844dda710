"""Parameter offload moves weights, never the math: gradients and parameters bitwise equal to
the plain step; the fake trace of the step equals ``track`` of the real one op by op."""

import warnings

import pytest
import torch

import memfit
from memfit.step import canonical_step, compute_loss, prepare_batch
from memfit.techniques.optimizer_offload import OptimizerOffload
from memfit.techniques.param_offload import ParamOffload
from memfit.trace import FakeCopier, profile_step
from tests.helpers import tiny


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="OptimizerOffload", category=UserWarning)
        yield


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _offloaded(model, policy, prefetch=True):
    """(the offloaded optimizer, the Change)."""
    tech = ParamOffload(ParamOffload.Config(policy, prefetch=prefetch))
    change = tech.apply(model, _adamw(model))
    return change.optimizer, change


@pytest.mark.parametrize("arch", ["gpt2", "bert-base"])
@pytest.mark.parametrize("policy,prefetch", [("all", True), ("every:2", True), ("all", False)])
def test_gradients_and_parameters_bitwise_equal_to_the_plain_step(arch, policy, prefetch):
    """Oracle: the same model and AdamW without any offload (optimizer offload alone is
    bitwise equal to it for fp32, optimizer_offload Note 1)."""
    (plain, batch), (model, _) = tiny(arch), tiny(arch)
    opt = _adamw(plain)
    off, handle = _offloaded(model, policy, prefetch)
    for k in range(3):
        for m, o in ((plain, opt), (model, off)):
            torch.manual_seed(k)                 # dropout draws the same masks
            o.zero_grad(set_to_none=True)
            compute_loss(m, batch).backward()
        assert all(torch.equal(p.grad, q.grad)
                   for p, q in zip(plain.parameters(), model.parameters(), strict=True))
        opt.step()
        off.step()
    # step 1's forward runs on the weights as they were; then each weight is fetched once for
    # each backward and each later forward
    chosen = [name for name, mode in ParamOffload(ParamOffload.Config(policy)).resolve(model)
              .items() if mode == "offload"]
    n = sum(1 for name in chosen for p in model.get_submodule(name).parameters())
    assert handle.stats.fetches == 5 * n
    assert handle.modes == {}           # the blocks' saved activations are as they were
    assert (handle.stats.prefetches > 0) == (prefetch and len(chosen) > 1)
    handle.remove()                              # fetches every weight back
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))


def test_backward_prefetches_each_block_before_the_one_it_reaches():
    """Note 3: when backward reaches block i it fetches block i-1 ahead, for every block but
    the first. (A block fetched ahead used to count as reached, so its own reach prefetched
    nothing: every other block came on demand.)"""
    spec = memfit.zoo.get("gpt2")
    model = spec.build(tiny=True, seed=0, n_layer=4)
    batch = spec.make_batch(model, 3, seq_len=16, seed=0)
    _, handle = _offloaded(model, "all")
    blocks = [name for name, mode in ParamOffload(ParamOffload.Config("all")).resolve(model)
              .items() if mode == "offload"]
    per_block = [len(list(model.get_submodule(name).parameters())) for name in blocks]
    assert len(blocks) == 4
    loss = compute_loss(model, batch)
    before = handle.stats.prefetches
    loss.backward()
    assert handle.stats.prefetches - before == sum(per_block[:-1])


def _traced_and_tracked(arch, policy):
    """(profile of the fake step, tracker of the real step 2), both with ``policy``."""
    model, batch = tiny(arch)
    batch = prepare_batch(batch)
    copier = FakeCopier("cpu")
    fake = copier.module(model)
    fake.train()
    fake_batch = copier.tree(batch)

    def build(m):
        if policy is None:
            return OptimizerOffload(OptimizerOffload.Config()).apply(m, _adamw(m)).optimizer
        return _offloaded(m, policy)[0]

    with copier.mode:
        fake_opt = build(fake)
    prof, _ = profile_step(lambda on_phase: canonical_step(fake, fake_opt, fake_batch),
                           copier=copier, model=fake, optimizer=fake_opt)
    opt = build(model)
    canonical_step(model, opt, batch)
    with memfit.track(model, opt) as t:
        canonical_step(model, opt, batch)
    return prof, t, model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "bert-base"])
@pytest.mark.parametrize("policy", ["all", "every:2"])
def test_trace_equals_track_and_weights_leave_the_device(arch, policy):
    prof, t, model = _traced_and_tracked(arch, policy)
    assert (prof.peak_bytes, prof.breakdown, prof.timeline) == \
        (t.peak_bytes, t.breakdown, t.timeline)
    assert prof.op_log == [str(op) for op in t.op_log]
    # what stays a device parameter: the weights outside offloaded blocks, and a 4-byte
    # placeholder per released weight (param_offload Note 1); fetched copies are temporaries
    blocks = ParamOffload(ParamOffload.Config(policy)).resolve(model)
    inside = {id(p) for n, m in blocks.items() if m == "offload"
              for p in model.get_submodule(n).parameters()}
    outside = sum(p.numel() * p.element_size() for p in model.parameters()
                  if id(p) not in inside)
    assert outside <= t.breakdown["params"] <= outside + 4 * len(inside)
    base, _, _ = _traced_and_tracked(arch, None)
    assert prof.peak_bytes < base.peak_bytes


def test_refuses_what_it_cannot_do():
    model, _ = tiny("gpt2")
    offloaded = OptimizerOffload(OptimizerOffload.Config()).apply(model, _adamw(model)).optimizer
    with pytest.raises(ValueError, match="before optimizer offload"):
        ParamOffload(ParamOffload.Config("all")).apply(model, offloaded)
    with pytest.raises(ValueError, match="checkpoint policy"):
        ParamOffload.Config("selective")
    with pytest.raises(ValueError, match="match no submodule"):
        ParamOffload(ParamOffload.Config(("nope",))).apply(model, _adamw(model))
    with pytest.raises(ValueError, match="nested"):
        ParamOffload(ParamOffload.Config(("transformer.h.0", "transformer.h.0.attn"))).apply(
            model, _adamw(model))


def test_remove_and_reapply():
    """After remove() the optimizer copies updated weights back as optimizer offload alone
    does; reapply() offloads them again; still bitwise equal to the plain step."""
    (plain, batch), (model, _) = tiny("gpt2"), tiny("gpt2")
    opt = _adamw(plain)
    off, handle = _offloaded(model, "all")
    for k in range(4):
        if k == 1:
            handle.remove()
        if k == 2:
            handle = handle.reapply()
        for m, o in ((plain, opt), (model, off)):
            torch.manual_seed(k)
            o.zero_grad(set_to_none=True)
            compute_loss(m, batch).backward()
            o.step()
        if k == 1:
            assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))
    handle.remove()
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters()))


def test_a_model_dropped_without_remove_is_collected():
    """The post-accumulate-grad hooks hold the fetcher weakly: a parameter keeps its tensor
    hooks from C++, out of the garbage collector's sight, so a strong hook made a cycle that
    kept the model, its weights and their host twins alive for good."""
    import gc
    import weakref

    model, batch = tiny("gpt2")
    opt, handle = _offloaded(model, "all")
    compute_loss(model, batch).backward()                # the hooks have run
    weight = weakref.ref(next(model.transformer.h[0].parameters()))
    del model, opt, handle, batch
    gc.collect()
    assert weight() is None
