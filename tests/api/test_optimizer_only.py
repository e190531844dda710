"""``estimate(optimizer_only=True)``: the step's optimizer phase alone (api._traced Note 1).

The planner models another optimizer implementation or a low-bit state from this trace, not
the whole step's (planner.variants). The oracle is the whole step traced with the same knobs:
its optimizer phase must run the same ops with the same costs, rise by the same bytes above
the level it starts from, and start with the same optimizer state alive.
"""

import pytest

import memfit
from memfit import zoo
from memfit.planner._trace_reads import level_before, optimizer_rise_bytes

GPU, A100 = "gtx-1080-ti", "a100-80gb"


@pytest.fixture(scope="module")
def job():
    """bert-base's widths, one layer, on the meta device, one short sample."""
    spec = zoo.get("bert-base")
    model = spec.build(device="meta", num_hidden_layers=1)
    return model, spec.make_batch(model, 2, seq_len=8)


CASES = [
    pytest.param(GPU, dict(precision="fp32", optimizer_impl="fused"), id="fused"),
    pytest.param(GPU, dict(precision="fp32", optimizer_impl="for-loop"), id="for-loop"),
    pytest.param(GPU, dict(precision="fp16", optimizer_state="8bit", max_grad_norm=1.0),
                 id="fp16-scaler-clip-8bit"),
    pytest.param("cpu", dict(precision="fp32", optimizer_state="bf16"), id="cpu-bf16-state"),
    pytest.param(A100, dict(precision="bf16", optimizer_state="4bit", max_grad_norm=1.0),
                 id="bf16-4bit-clip"),
]


@pytest.mark.parametrize("device,knobs", CASES)
def test_the_optimizer_phase_alone_is_the_whole_steps(job, device, knobs):
    if "optimizer_state" in knobs:
        pytest.importorskip("bitsandbytes" if knobs["optimizer_state"] == "8bit"
                            else "torchao.optim")
    model, batch = job
    whole = memfit.estimate(model, batch, device=device, allocator_replay=False, **knobs)
    alone = memfit.estimate(model, batch, device=device, optimizer_only=True, **knobs)
    start = whole.phases["optimizer"]
    assert alone.phases == {"optimizer": 0}
    assert alone.op_log == whole.op_log[start:] and len(alone.op_log) > 0
    assert alone.op_costs == whole.op_costs[start:]
    rise = [t - level_before(whole, start) for t in whole.timeline[start:]]
    assert [t - level_before(alone, 0) for t in alone.timeline] == rise
    assert optimizer_rise_bytes(alone) == optimizer_rise_bytes(whole) == max(max(rise), 0)
    state = level_before(whole, start, "optimizer")
    assert level_before(alone, 0, "optimizer") == state > 0
    assert set(whole.timeline_by_category["optimizer"][:start]) == {state}   # alive throughout
    if device != "cpu":     # the state as the allocator-replayed step (two steps) starts it
        replayed = memfit.estimate(model, batch, device=device, **knobs)
        assert level_before(replayed, replayed.phases["optimizer"], "optimizer") == state
        # the planner traces the phase alone without the replay (api._planner Note 5): what
        # its models read is the same with it
        again = memfit.estimate(model, batch, device=device, optimizer_only=True,
                                allocator_replay=False, **knobs)
        assert (again.timeline, again.op_costs, again.phases, again.start_breakdown) == \
            (alone.timeline, alone.op_costs, alone.phases, alone.start_breakdown)


def test_a_step_without_a_phase_of_its_own_is_traced_whole(job):
    """The optimizer stepped in backward, or a user's step, has no optimizer phase of memfit's
    to trace alone: the whole step is traced, as without ``optimizer_only``."""
    model, batch = job
    def step(m, b, o):
        m(**b).loss.backward()
        o.step()
        o.zero_grad()

    for knobs in (dict(optimizer_in_backward=True), dict(step=step)):
        alone = memfit.estimate(model, batch, optimizer_only=True, **knobs)
        whole = memfit.estimate(model, batch, **knobs)
        assert "forward" in alone.phases
        assert (alone.peak_bytes, alone.op_log) == (whole.peak_bytes, whole.op_log)


def test_the_phase_alone_is_one_cache_entry_for_every_batch(tmp_path):
    """It reads no batch (api._traced.phase_alone): under a front's cache, another batch of
    the same model reads the entry, with the figures a fresh trace at that batch gives; a step
    traced whole (the optimizer in backward) still keys its batch."""
    from memfit import zoo
    from memfit._cache import Cache
    from memfit._trace_cache_scope import using

    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    small, large = spec.make_batch(model, 2, seq_len=8), spec.make_batch(model, 5, seq_len=16)
    knobs = dict(device=A100, precision="bf16", optimizer_impl="for-loop", optimizer_only=True)
    with using(Cache(tmp_path)):
        memfit.estimate(model, small, **knobs)
        kept = memfit.estimate(model, large, **knobs)
        memfit.estimate(model, small, optimizer_in_backward=True, **knobs)
        whole = memfit.estimate(model, large, optimizer_in_backward=True, **knobs)
    fresh = memfit.estimate(model, large, **knobs)
    assert kept.traced_as.endswith("read from memfit's cache")
    assert (kept.timeline, kept.op_costs, kept.start_breakdown, kept.notes) == \
        (fresh.timeline, fresh.op_costs, fresh.start_breakdown, fresh.notes)
    assert "read from memfit's cache" not in whole.traced_as and "forward" in whole.phases
