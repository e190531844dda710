"""DTR simulated on a traced step: hand-computed cases, and the real runtime as the oracle."""

import pytest
import torch

import memfit
from memfit.step import canonical_step
from memfit.trace.dtr_sim import BlockSpan, simulate_dtr, spans_from_modules
from tests.techniques.test_remat import build


def test_hand_computed_replay():
    # ops 0..9; block a: fw 1-2, bw 7-8; block b: fw 3-4, bw 5-6
    timeline = [10, 30, 40, 60, 70, 80, 60, 50, 20, 10]
    a = BlockSpan("a", (1, 2), (7, 8), evictable_bytes=25, fw_flops=100)
    b = BlockSpan("b", (3, 4), (5, 6), evictable_bytes=30, fw_flops=100)
    sim = simulate_dtr(timeline, [a, b], budget_bytes=55, min_evict_bytes=1)
    # op 4 (70): only a is a candidate (b still running) -> evict a: 45; op 5: b's backward
    # begins (b was never evicted), 80 - 25 = 55; op 7: a's backward: recompute, 50
    assert (sim.evictions, sim.evicted, sim.recompute_flops) == (1, ["a"], 100)
    assert sim.peak_bytes == 55 and sim.plain_peak_bytes == 80
    # floor: op 5 has a only: 80 - 25 = 55; op 4 (70 - 25 = 45); op 6 (60 - 25 = 35)
    assert sim.floor_bytes == 55 and sim.feasible
    assert not simulate_dtr(timeline, [a, b], 54, min_evict_bytes=1).feasible


def test_staleness_picks_the_older_block():
    timeline = [0, 10, 20, 30, 40, 50, 40, 30, 20, 10, 0]
    a = BlockSpan("a", (1, 1), (9, 9), evictable_bytes=10, fw_flops=100)
    b = BlockSpan("b", (2, 2), (8, 8), evictable_bytes=10, fw_flops=100)
    sim = simulate_dtr(timeline, [a, b], budget_bytes=40, min_evict_bytes=1)
    assert sim.evicted == ["a"]           # same cost and bytes: the staler one goes


def _runtime(name, budget):
    model, batch = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    canonical_step(model, opt, batch)
    with memfit.track(model, opt, budget=budget) as t, memfit.remat(model=model) as s:
        canonical_step(model, opt, batch)
    return t, s.stats


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "bert-base"])
@pytest.mark.parametrize("frac", [0.8, 0.6])
def test_prediction_equals_the_runtime_where_evictions_do_not_chain(name, frac):
    model, batch = build(name)
    plain = memfit.estimate(model, batch, "sgd")
    budget = int(plain.peak_bytes * frac)
    est = memfit.estimate(model, batch, "sgd", budget=budget, remat=True)
    sim = simulate_dtr(plain.timeline, spans_from_modules(plain.modules, plain.blocks), budget)
    assert (est.remat_peak_bytes, est.remat_recompute_flops, est.remat_floor_bytes) == \
        (sim.peak_bytes, sim.recompute_flops, sim.floor_bytes)
    assert est.peak_bytes == plain.peak_bytes          # the traced figures stay the plain step's
    t, stats = _runtime(name, budget)
    assert t.peak_bytes <= budget and sim.peak_bytes <= budget
    assert (stats.evictions, stats.recompute_flops) == (sim.evictions, sim.recompute_flops)


def test_without_budget_or_remat_nothing_is_simulated():
    model, batch = build("gpt2", layers=2, seq_len=16)
    assert memfit.estimate(model, batch, "sgd", remat=True).remat_peak_bytes is None
    assert memfit.estimate(model, batch, "sgd", budget=10**9).remat_peak_bytes is None
