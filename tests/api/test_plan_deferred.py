"""The for-loop optimizer weighed by a bound until a pick needs it (``api._plan_deferred``).

The premises of the bound are held on each class it is used for, and the plans are held to the
plans made with the for-loop traced up front (the oracle: ``BOUNDED`` emptied), where the bound
is picked (then traced) and where it is not (then never traced).
"""

import pytest

import memfit
from memfit import zoo
from memfit.api import _plan_deferred
from memfit.api._setup import resolve_device
from memfit.optimizers import OptimizerRecipe
from memfit.planner._trace_reads import level_before, optimizer_rise_bytes
from memfit.planner.memory_model import MemoryModel
from memfit.planner.time_model import TimeModel
from tests.helpers import tiny

GPU = "gtx-1080-ti"
NAMES = ("adamw", "adam", "sgd", "momentum", "rmsprop", "adagrad")


def test_every_bounded_class_is_tested_here():
    model, _ = tiny("gpt2")
    params = [p for p in model.parameters() if p.requires_grad]
    tested = {OptimizerRecipe(name).optimizer_class(params) for name in NAMES}
    assert set(_plan_deferred._CLASSES) <= tested


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("precision,device", [("fp16", GPU), ("bf16", "a100-80gb")])
def test_the_for_loop_keeps_foreach_state_rises_at_least_0_and_is_priced_slower(
        name, precision, device):
    model, batch = tiny("gpt2")
    spec = resolve_device(model, device)
    out = {}
    for impl in ("foreach", "for-loop"):
        est = memfit.estimate(memfit.Job(model, batch, optimizer=name), device=device,
                              precision=precision, optimizer_only=True,
                              allocator_replay=False, optimizer_impl=impl, max_grad_norm=1.0)
        start = est.phases["optimizer"]
        memory = MemoryModel(est, 3)
        out[impl] = (level_before(est, start, "optimizer"), level_before(est, start),
                     optimizer_rise_bytes(est), TimeModel(est, spec, precision, 3, memory))
    (state, level, _, foreach), (loop_state, loop_level, rise, loop) = \
        out["foreach"], out["for-loop"]
    assert (loop_state, loop_level) == (state, level) and rise >= 0
    assert loop.optimizer_s > foreach.optimizer_s
    assert loop.forward_backward_s(1, 3) == foreach.forward_backward_s(1, 3)


def _bert():
    """bert-base's widths, one layer, one short sample: the optimizer step peaks."""
    spec = zoo.get("bert-base")
    model = spec.build(device="meta", num_hidden_layers=1)
    return model, spec.make_batch(model, 1, seq_len=8)


def _plans(monkeypatch, job, **kwargs):
    """(the plan with the bound, its stages; the plan with the for-loop traced up front)."""
    said = []
    bounded = memfit.plan(job, device=GPU, on_progress=said.append, **kwargs)
    monkeypatch.setattr(_plan_deferred, "BOUNDED", ())
    traced = memfit.plan(job, device=GPU, **kwargs)
    return bounded, said, traced


def _same(a, b):
    assert a.knobs == b.knobs
    assert a.predicted_device_bytes == b.predicted_device_bytes
    assert a.predicted_step_time_ratio == b.predicted_step_time_ratio
    assert a.reasons == b.reasons


def test_a_picked_bound_traces_the_for_loop_and_plans_as_if_traced_up_front(monkeypatch):
    model, batch = _bert()
    job = memfit.Job(model, batch, optimizer="rmsprop")      # no fused RMSprop: for-loop only
    foreach = memfit.estimate(job, device=GPU)
    loop = memfit.estimate(job, device=GPU, optimizer_impl="for-loop")
    assert loop.device_bytes < foreach.device_bytes           # the premise, traced
    budget = (foreach.device_bytes + loop.device_bytes) // 2
    bounded, said, traced = _plans(monkeypatch, job, budget=budget)
    assert bounded.knobs.optimizer_impl == "for-loop"
    assert bounded.predicted_device_bytes <= budget
    _same(bounded, traced)
    tracing = [s for s in said if "for-loop implementation" in s]
    assert len(tracing) == 1 and said.index(tracing[0]) > said.index("searching")


def test_a_bound_not_picked_is_never_traced_and_the_plan_is_the_same(monkeypatch):
    model, batch = tiny("gpt2", batch_size=8, seq_len=64)
    job = memfit.Job(model, batch, optimizer="rmsprop")
    plain = memfit.estimate(job, device=GPU)
    budget = plain.device_bytes - 1          # the activations must give way, not the optimizer
    bounded, said, traced = _plans(monkeypatch, job, budget=budget)
    assert "searching" in said and not any("for-loop" in s for s in said)
    assert bounded.knobs.optimizer_impl is None
    _same(bounded, traced)


def test_the_floor_traces_the_for_loop(monkeypatch):
    model, batch = _bert()
    job = memfit.Job(model, batch, optimizer="rmsprop")
    said = []
    p = memfit.plan(job, device=GPU, floor=True, on_progress=said.append)
    assert any("for-loop implementation" in s for s in said)
    monkeypatch.setattr(_plan_deferred, "BOUNDED", ())
    assert memfit.plan(job, device=GPU, floor=True).floor_bytes == p.floor_bytes
