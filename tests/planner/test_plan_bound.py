"""The user's precision held back under "auto" (api._plan_bound): every configuration at a
precision is priced at least its forward and backward of the whole batch in one micro-batch
(the bound), and a plan whose found step is no slower than that bound is the plan found with the
precision traced, made with fewer traces.

Oracles: the time model's own price of each configuration the search weighs (the bound must be
below every one), and the plan made with the bound switched off.
"""

import itertools

import pytest

import memfit
from memfit import zoo
from memfit.api import _plan_bound, _planner
from memfit.api._plan_parts import precision_models
from memfit.devices import get_device
from memfit.modes import Mode
from tests.helpers import tiny


def test_the_bound_is_below_every_configuration_of_the_precision():
    """Micro-batches, per-block keep / recompute / selective / offload and the optimizer on the
    host or not: none is priced under the forward and backward of one micro-batch."""
    model, batch = tiny("gpt2", batch_size=8, seq_len=32)
    spec, b = get_device("gtx-1080-ti"), 8
    plain = memfit.estimate(model, batch, device=spec, precision="fp32")
    memory, time = precision_models(model, batch, plain, dict(device=spec), spec, "fp32", b,
                                    None, lambda message: None)
    bound = time.forward_backward_s(1, b)
    blocks = len(memory.blocks)
    assert blocks >= 2
    modes = [Mode.KEEP, Mode.RECOMPUTE, Mode.SELECTIVE, Mode.OFFLOAD]
    priced = [time.step_s(m, b, mix, host)
              for m in (1, 2, 3, 4, 8)
              for mix in itertools.product(modes, repeat=blocks)
              for host in (False, True)]
    assert min(priced) >= bound
    assert _plan_bound.may_beat((memory, time), b, bound * 1.01)
    assert not _plan_bound.may_beat((memory, time), b, bound)
    assert _plan_bound.may_beat((memory, time), b, None)        # nothing found: weigh it


@pytest.mark.slow        # two plans of a GPU target under "auto" (~40 s on 2 cores)
def test_a_plan_with_the_user_precision_held_back_is_the_plan_without(monkeypatch):
    """On a GTX 1080 Ti auto searches fp16 and weighs fp32; where the fp16 pick is faster than
    fp32's bound, fp32's half-batch and in-backward traces are skipped, and the plan is the
    same as with them (a 4-block GPT-2 at 16 x 512, on the meta device)."""
    spec = zoo.get("gpt2")
    model = spec.build(device="meta", n_layer=4)
    batch = spec.make_batch(model, 16, seq_len=512)
    del batch["attention_mask"]
    job = memfit.Job(model, batch)
    plain = memfit.estimate(job, device="gtx-1080-ti", precision="fp32")
    budget = plain.device_bytes - plain.peak_bytes // 3
    plans, stages = [], []
    for bounded in (True, False):
        if not bounded:
            monkeypatch.setattr(_planner, "may_beat", lambda *args: True)
        said = []
        plans.append(memfit.plan(job, budget=budget, device="gtx-1080-ti", precision="auto",
                                 on_progress=said.append))
        stages.append(said)
    held, weighed = plans
    assert held.knobs == weighed.knobs and held.knobs.precision == "fp16"
    assert held.predicted_device_bytes == weighed.predicted_device_bytes <= budget
    assert held.predicted_step_time_ratio == weighed.predicted_step_time_ratio
    for said, fp32_traced in zip(stages, (False, True)):     # fp32's half batch, in backward
        assert any("(fp32, batch 8)" in s for s in said) == fp32_traced
        assert any("optimizer in backward (fp32)" in s for s in said) == fp32_traced
    assert stages[0][-1].number <= stages[0][-1].expected        # the ETA's count held
