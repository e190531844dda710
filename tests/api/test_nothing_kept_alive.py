"""After a memfit call returns and the user drops the model, nothing of it stays (issue 11
item 7). Independent oracles, not memfit's counters: weak references to the user's model and
optimizer (dead after ``gc.collect()``), and the count of live ``torch.Tensor`` objects the
garbage collector knows of (fakes counted apart), which must not grow from call to call.
A tensor kept from C++ (an autograd node, a hook) keeps its Python object too, so it is seen.
"""

import gc
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor

import memfit
from memfit.step import canonical_step, prepare_batch
from tests.helpers import tiny

# every knob fixed: the plan traces and verifies one configuration (a few seconds)
FIXED = dict(precision="fp32", micro_batch_size=2, checkpoint="none", offload="none",
             offload_optimizer=False)


def live_tensors() -> tuple[int, int]:
    """(all tensors, of which fake) alive now."""
    gc.collect()
    tensors = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
    return len(tensors), sum(isinstance(t, FakeTensor) for t in tensors)


def grows(call, n=1) -> list[tuple[int, int]]:
    """Live tensors after a first ``call`` (lazy initialisation), then after each of ``n``
    more: all equal when nothing is kept."""
    call()
    counts = [live_tensors()]
    for _ in range(n):
        call()
        counts.append(live_tensors())
    return counts


def build():
    model, batch = tiny("gpt2", batch_size=2, seq_len=8)
    return model, prepare_batch(batch), torch.optim.AdamW(model.parameters())


def assert_dead(*refs):
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


def test_estimate_keeps_no_fake_tensor():
    model, batch, _ = build()
    counts = grows(lambda: memfit.estimate(model, batch, checkpoint="all"))
    assert counts == [counts[0]] * len(counts), counts


def test_plan_keeps_no_fake_tensor():
    model, batch, _ = build()
    counts = grows(lambda: memfit.plan(model, batch, budget="64MiB", **FIXED))
    assert counts == [counts[0]] * len(counts), counts


def test_track_keeps_neither_the_model_nor_the_optimizer():
    kept = []

    def call():
        model, batch, opt = build()
        canonical_step(model, opt, batch)
        with memfit.track(model, opt) as t:
            canonical_step(model, opt, batch)
        kept.append((t, weakref.ref(model), weakref.ref(opt)))

    counts = grows(call)
    assert counts == [counts[0]] * len(counts), counts
    assert_dead(*[r for _, *refs in kept for r in refs])
    assert all(t.peak_bytes > 0 and t.modules for t, *_ in kept)   # the figures stay


def test_a_model_dropped_after_fit_is_gone():
    refs = []

    def call():
        model, batch, opt = build()
        runner = memfit.fit(model, opt, batch, **FIXED)
        runner.step(batch)
        refs.extend([weakref.ref(model), weakref.ref(opt), weakref.ref(runner)])

    counts = grows(call)
    assert counts == [counts[0]] * len(counts), counts
    assert_dead(*refs)


def test_remat_keeps_neither_the_model_nor_the_optimizer():
    kept = []

    def call():
        model, batch, opt = build()
        with memfit.remat(budget="64MiB", model=model, optimizer=opt) as session:
            canonical_step(model, opt, batch)
        kept.append((session, weakref.ref(model), weakref.ref(opt)))

    counts = grows(call)
    assert counts == [counts[0]] * len(counts), counts
    assert_dead(*[r for _, *refs in kept for r in refs])


def test_estimate_inside_track_keeps_nothing_either():
    def call():
        model, batch, opt = build()
        with memfit.track(model, opt):
            canonical_step(model, opt, batch)
            memfit.estimate(model, batch)
        return weakref.ref(model)

    counts = grows(call)
    assert counts == [counts[0]] * len(counts), counts
    assert_dead(call())


def test_an_fsdp_offload_estimate_keeps_no_fake_tensor():
    """A rank of FSDP2 with CPU offload, traced for a GPU: its placement's gradient hooks on the
    fake shards held the placement (a bound method), hence its optimizer and every shard, a
    cycle through C++ the gc cannot see: each estimate left its fake sharded model alive."""
    from memfit.api._sharded import estimate_sharded

    model, batch, _ = build()
    counts = grows(lambda: estimate_sharded(model, batch, device="a100-40gb", world_size=2,
                                            sharding="fsdp", fsdp_offload=True))
    assert counts == [counts[0]] * len(counts), counts
