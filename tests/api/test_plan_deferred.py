"""The for-loop and fused optimizer steps and the bf16 and 4-bit optimizer states weighed by
bounds until a pick needs one (``api._plan_deferred``).

The premises of each bound are held on each class it is used for, and the plans are held to the
plans made with every implementation traced up front (the oracle: ``BOUNDED`` emptied), where a
bound is picked (then traced) and where it is not (then never traced).
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
FUSED = ("adamw", "adam", "sgd", "momentum", "adagrad")        # the classes with a fused step


def test_every_bounded_class_is_tested_here():
    model, _ = tiny("gpt2")
    params = [p for p in model.parameters() if p.requires_grad]
    for impl, names in (("for-loop", NAMES), ("fused", FUSED)):
        tested = {OptimizerRecipe(name).optimizer_class(params) for name in names}
        assert set(_plan_deferred._CLASSES[impl]) <= tested
    assert set(_plan_deferred._CLASSES) == set(_plan_deferred.BOUNDED)
    tested = {OptimizerRecipe(name).optimizer_class(params) for name in ("adam", "adamw")}
    assert set(_plan_deferred._STATE_CLASSES) <= tested


def _phase(model, batch, name: str, device: str, precision: str, **knobs):
    """(trace, memory model, time model) of the optimizer phase alone of ``name``."""
    est = memfit.estimate(memfit.Job(model, batch, optimizer=name), device=device,
                          precision=precision, optimizer_only=True, allocator_replay=False,
                          **knobs)
    memory = MemoryModel(est, 3)
    return est, memory, TimeModel(est, resolve_device(model, device), precision, 3, memory)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("precision,device", [("fp16", GPU), ("bf16", "a100-80gb")])
def test_the_for_loop_keeps_foreach_state_rises_at_least_0_and_is_priced_slower(
        name, precision, device):
    model, batch = tiny("gpt2")
    out = {}
    for impl in ("foreach", "for-loop"):
        est, _, time = _phase(model, batch, name, device, precision, optimizer_impl=impl,
                              max_grad_norm=1.0)
        start = est.phases["optimizer"]
        out[impl] = (level_before(est, start, "optimizer"), level_before(est, start),
                     optimizer_rise_bytes(est), time)
    (state, level, _, foreach), (loop_state, loop_level, rise, loop) = \
        out["foreach"], out["for-loop"]
    assert (loop_state, loop_level) == (state, level) and rise >= 0
    assert loop.optimizer_s > foreach.optimizer_s
    assert loop.forward_backward_s(1, 3) == foreach.forward_backward_s(1, 3)


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("precision,device", [("fp16", GPU), ("bf16", "a100-80gb"),
                                              ("bf16-pure", "a100-80gb")])
def test_the_fused_step_touches_the_gradients_twice_and_the_state_once_at_least(
        name, precision, device):
    model, batch = tiny("gpt2")
    _, memory, foreach = _phase(model, batch, name, device, precision,
                                optimizer_impl="foreach", max_grad_norm=1.0)
    est, _, fused = _phase(model, batch, name, device, precision, optimizer_impl="fused",
                           max_grad_norm=1.0)
    least = 2 * memory.grads_bytes + memory.optimizer_state_bytes
    assert memory.grads_bytes > 0 and optimizer_rise_bytes(est) >= 0
    assert fused._opt_touched >= least
    bound = foreach.with_optimizer_touching(least)
    assert fused.optimizer_s >= bound.optimizer_s
    for placement in (False, True):
        assert fused.optimizer_step_s(placement) >= bound.optimizer_step_s(placement)
    assert fused.forward_backward_s(1, 3) == foreach.forward_backward_s(1, 3)


def _bert_layers(layers: int, seq_len: int, batch_size: int):
    spec = zoo.get("bert-base")
    model = spec.build(device="meta", num_hidden_layers=layers)
    return model, spec.make_batch(model, batch_size, seq_len=seq_len)


@pytest.mark.parametrize("state", _plan_deferred.BOUNDED_STATES)
@pytest.mark.parametrize("name", ("adam", "adamw"))
@pytest.mark.parametrize("precision,device", [("fp16", GPU), ("bf16", "a100-80gb")])
@pytest.mark.parametrize("job", ("gpt2", "bert"))
def test_a_low_bit_state_holds_its_codes_rises_at_least_0_and_touches_its_bound(
        state, name, precision, device, job):
    """gpt2's tiny widths keep every moment in fp32 (too small for torchao's blocks), bert's
    its matrices in ``state`` and its vectors in fp32."""
    model, batch = tiny("gpt2") if job == "gpt2" else _bert()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    _, memory, time = _phase(model, batch, name, device, precision)
    est = _phase(model, batch, name, device, precision, optimizer_state=state)[0]
    real = (memory.with_optimizer_state(est), time.with_optimizer_step(est))
    bound = _plan_deferred.state_bound(memory, time, state, numel)
    assert real[0].optimizer_state_bytes >= bound[0].optimizer_state_bytes > 0
    assert optimizer_rise_bytes(est) >= 0 == bound[0]._opt_rise
    assert real[1]._opt_touched >= bound[1]._opt_touched
    for placement in (False, True):
        assert real[1].optimizer_step_s(placement) >= bound[1].optimizer_step_s(placement)


def _bert():
    """bert-base's widths, one layer, one short sample: the optimizer step peaks."""
    return _bert_layers(1, 8, 1)


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


@pytest.mark.parametrize("name", ("adamw", "adagrad"))
def test_a_picked_fused_bound_traces_the_fused_step_and_plans_as_if_traced_up_front(
        monkeypatch, name):
    model, batch = _bert()
    job = memfit.Job(model, batch, optimizer=name)
    foreach = memfit.estimate(job, device=GPU)
    fused = memfit.estimate(job, device=GPU, optimizer_impl="fused")
    assert fused.device_bytes < foreach.device_bytes          # no parameter-sized temporaries
    budget = (foreach.device_bytes + fused.device_bytes) // 2
    bounded, said, traced = _plans(monkeypatch, job, budget=budget)
    assert bounded.knobs.optimizer_impl == "fused"
    _same(bounded, traced)
    tracing = [s for s in said if "implementation" in s]
    assert tracing == ["tracing the optimizer step with the fused implementation"]
    assert said.index(tracing[0]) > said.index("searching")


def test_a_low_bit_pick_never_traces_the_fused_step_and_the_plan_is_the_same(monkeypatch):
    model, batch = _bert()
    job = memfit.Job(model, batch, optimizer="adamw")
    budget = int(memfit.estimate(job, device=GPU).device_bytes * 0.9)
    bounded, said, traced = _plans(monkeypatch, job, budget=budget, precision="auto")
    assert bounded.knobs.optimizer_state == "8bit"
    assert "searching" in said and not any("implementation" in s for s in said)
    _same(bounded, traced)


def test_a_plain_step_that_fits_traces_no_other_implementation(monkeypatch):
    model, batch = _bert()
    job = memfit.Job(model, batch, optimizer="adamw")
    bounded, said, traced = _plans(monkeypatch, job)
    assert said == ["tracing the plain step (fp32, batch 1)"]
    _same(bounded, traced)


def _state_plans(monkeypatch, job, budget):
    said = []
    kwargs = dict(device=GPU, budget=budget, allow_numerics_change=True)
    bounded = memfit.plan(job, on_progress=said.append, **kwargs)
    monkeypatch.setattr(_plan_deferred, "BOUNDED_STATES", ())
    return bounded, said, memfit.plan(job, **kwargs)


@pytest.mark.parametrize("fraction,picked", [(0.72, True), (0.66, False)])
def test_state_bounds_picked_or_not_plan_as_if_every_state_were_traced_up_front(
        monkeypatch, fraction, picked):
    """bert-base's widths, 2 layers, 4 x 128, on a GTX 1080 Ti: at 72% of the plain step the
    4-bit bound is picked (traced after the search; 8-bit with the state on the host wins), at
    66% neither bound is (the state and gradients on the host win)."""
    model, batch = _bert_layers(2, 128, 4)
    job = memfit.Job(model, batch, optimizer="adamw")
    budget = int(memfit.estimate(job, device=GPU).device_bytes * fraction)
    bounded, said, traced = _state_plans(monkeypatch, job, budget)
    _same(bounded, traced)
    states = [s for s in said if "bf16 optimizer state" in s or "4bit optimizer state" in s]
    tracing = [s for s in states if s.startswith("tracing")]
    assert said.index("tracing the optimizer step with 8bit optimizer state (fp32)") < \
        said.index("searching")
    if picked:
        assert tracing and all(said.index(s) > said.index("searching") for s in tracing)
    else:
        assert not tracing
