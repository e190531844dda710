"""Parameter offload as a planner lever (issue 15 item 1): weighed when nothing that keeps the
weights on the device fits, exact against ``memfit.track`` on CPU.

Oracles: a real run of the configuration under ``memfit.track`` (the planner's model and its
re-trace must equal it to the byte); the floor without the lever, traced by the planner.
(Training with ``offload_params`` is bitwise the plain step's: tests/api/test_offload_params_knob.py.)
"""

import warnings

import numpy as np
import pytest

import memfit
from memfit.planner.memory_model import MODES, MemoryModel
from memfit.planner.choice import Constraints, variant_key
from memfit.planner.search import search
from memfit.planner.time_model import TimeModel
from tests.helpers import tiny, track_runner_step


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="OptimizerOffload", category=UserWarning)
        yield


def _gpt2(b=1):
    model, batch = tiny("gpt2", batch_size=b, seq_len=16)
    del batch["attention_mask"]           # all ones: the plan would count it held
    return model, batch


def test_param_offload_model_predicts_what_track_measures_and_is_a_last_resort():
    model, batch = _gpt2()
    knobs = dict(offload_params="all", offload_optimizer=True)
    alone = memfit.estimate(model, batch, offload_optimizer=True)
    est = memfit.estimate(model, batch, **knobs)
    memory = MemoryModel(est, 1).limited(placements=(True,), excluded_modes=("offload",))
    x = np.zeros(len(memory.blocks) * len(MODES))
    x[[i * len(MODES) for i in range(len(memory.blocks))]] = 1.0
    predicted = memory.rows(1, 1, accumulate=False, offload_optimizer=True).peak(x)
    measured = track_runner_step(model, batch, "adamw", **knobs)
    assert predicted == measured.peak_bytes < alone.peak_bytes
    assert memory.allowed(0) == ("keep", "recompute", "selective")
    # in the search: only where the weights-on-device model has nothing under the budget
    spec = est.device
    plain = memfit.estimate(model, batch)
    base_mem = MemoryModel(plain, 1)
    models = {("fp32", None): (base_mem, TimeModel(plain, spec, "fp32", 1, base_mem)),
              variant_key("fp32", None, None, "all"): (memory, TimeModel(est, spec, "fp32", 1,
                                                                            memory))}
    fixed = Constraints(micro_batch_size=1, modes={n: ("keep",) for n in memory.blocks})
    assert search(models, 1, int(predicted), fixed).offload_params == "all"
    assert search({("fp32", None): models[("fp32", None)]}, 1, int(predicted), fixed) is None
    roomy = search(models, 1, alone.peak_bytes, fixed)
    assert roomy.offload_params is None and roomy.offload_optimizer


@pytest.mark.slow      # two plans with floors (~1 min on 2 cores); light sibling above
def test_plan_offloads_parameters_below_every_other_floor():
    """The gradients stay on the device (``offload_gradients=False``): the lever weighed
    before parameter offload, which on this tiny model goes lower than it does."""
    model, batch = _gpt2(2)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=1, offload_params="none", offload_gradients=False,
                    floor=True)
    without = info.value.floor_bytes
    p = memfit.plan(model, batch, budget=without - 1, offload_gradients=False)
    assert p.knobs.offload_params == "all" and p.knobs.offload_optimizer
    assert any("block weights on the host" in r for r in p.reasons)
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    measured = track_runner_step(*_gpt2(2), "adamw", **knobs)
    assert measured.peak_bytes == p.predicted_peak_bytes <= without - 1
