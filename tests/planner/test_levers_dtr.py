"""DTR as a planner choice (issue 15 item 2): ``plan(remat=True)`` plans it; with remat unset
the planner weighs it against the static plans and takes it where it is predicted faster: on
a variable-length workload (a static plan pays its recompute on every batch, DTR only on the
long ones), not on a fixed one. The plan it takes is run and measured under the budget.

Oracles: ``memfit.track(budget=...)`` on CPU around real steps of the runner ``fit`` builds from
the plan (it raises ``memfit.OutOfMemory`` past the budget), and DTR's simulation of the same
trace (``trace.dtr_sim``) for the eviction counts.
"""

import pytest
import torch

import memfit
from memfit.planner.remat_choice import remat_on, static_seconds
from memfit.trace.dtr_sim import simulate_dtr, spans_from_modules
from tests.helpers import foreign_bytes, tiny


def _gpt2(seq_len=64):
    model, batch = tiny("gpt2", batch_size=2, seq_len=seq_len)
    del batch["attention_mask"]           # all ones: the plan would count it held
    return model, batch


def _short(batch, n=16):
    return {k: v[:, :n].clone() for k, v in batch.items()}


def _measured_under(plan, model, batches, budget):
    """Real steps of the plan's runner, each under track(budget) (raises past it). DTR's session
    counts every byte in the process (remat Note 8), so the runner is given what other tests
    left alive on top (helpers.foreign_bytes); track holds the job itself to ``budget``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    knobs = {k: v for k, v in plan.knobs.to_dict().items() if v is not None}
    job = list(model.parameters()) + [t for t in batches[0].values() if torch.is_tensor(t)]
    runner = memfit.fit(model, opt, batches[0], budget=budget + foreign_bytes(job), **knobs)
    try:
        runner.step(batches[0])                      # steady state: optimizer state exists
        peaks = []
        for b in batches:
            with memfit.track(runner.model, runner.optimizer, budget=budget) as t:
                runner.step(b)
            peaks.append(t.peak_bytes)
        return peaks
    finally:
        runner.close()


def test_remat_on_one_trace_follows_the_simulation():
    model, batch = _gpt2()
    est = memfit.estimate(model, batch)
    roomy = remat_on(est, est.device, "fp32", 2, est.peak_bytes)
    assert roomy.fits and roomy.evictions == 0 and roomy.remat_s == roomy.plain_s
    cap = int(est.peak_bytes * 0.85)
    tight = remat_on(est, est.device, "fp32", 2, cap)
    sim = simulate_dtr(est.timeline, spans_from_modules(est.modules, est.blocks), cap)
    assert tight.fits and (tight.evictions, tight.recompute_flops) == \
        (sim.evictions, sim.recompute_flops) and tight.evictions >= 1
    assert sim.peak_bytes <= tight.peak_bytes <= cap and tight.remat_s > tight.plain_s
    assert static_seconds(1.5, [roomy, tight]) == pytest.approx(1.5 * 2 * roomy.plain_s)


@pytest.mark.slow
def test_plan_with_remat_fixed_plans_dtr_and_the_run_stays_under_the_budget():
    model, batch = _gpt2()
    budget = int(memfit.estimate(model, batch).peak_bytes * 0.85)
    p = memfit.plan(model, batch, budget=budget, remat=True)
    assert p.knobs.remat is True and p.predicted_peak_bytes <= budget
    assert "DTR" in p.explain() and p.predicted_step_time_ratio > 1.0
    m, b = _gpt2()
    peaks = _measured_under(p, m, [b, b], budget)
    assert max(peaks) <= budget
    with pytest.raises(ValueError, match="remat=True with checkpoint fixed"):
        memfit.plan(model, batch, budget=budget, remat=True, checkpoint="all")
    with pytest.raises(memfit.BudgetTooSmall, match="DTR cannot keep"):
        memfit.plan(model, batch, budget=budget // 4, remat=True)


@pytest.mark.slow      # two plans and six DTR traces (~1-2 min on 2 cores); siblings above
def test_dtr_is_chosen_on_variable_lengths_and_not_on_a_fixed_length():
    model, batch = _gpt2()
    budget = int(memfit.estimate(model, batch).peak_bytes * 0.85)
    varied = [batch] + [_short(batch)] * 5
    fixed = memfit.plan(model, batch, budget=budget, offload_optimizer=False,
                        batches=[batch] * 3)
    assert not fixed.knobs.remat and set(fixed.blocks.values()) != {"keep"}
    chosen = memfit.plan(model, batch, budget=budget, offload_optimizer=False, batches=varied)
    assert chosen.knobs.remat is True
    assert chosen.predicted_step_time_ratio < fixed.predicted_step_time_ratio
    assert any("DTR (remat) over the 6 workload batch(es)" in r for r in chosen.reasons)
    m, b = _gpt2()
    peaks = _measured_under(chosen, m, [b] + [_short(b)] * 5, budget)
    assert max(peaks) <= budget
