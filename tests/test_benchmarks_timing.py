"""The benchmarks' interleaving helper (benchmarks/_timing.py): the schedule and the ratio
arithmetic, with a fake clock (no wall-time asserts)."""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parent.parent / "benchmarks" / "_timing.py"
_spec = importlib.util.spec_from_file_location("_bench_timing", _PATH)
timing = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = timing          # dataclasses look their module up there
_spec.loader.exec_module(timing)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_order_every_position_and_every_predecessor_equally_often(n):
    """Williams design: over one period (n rounds, 2n when n is odd) each setting runs once per
    round, in each position equally often, and right after each other setting equally often."""
    period = n if n % 2 == 0 else 2 * n
    plan = timing.schedule(n, period)
    for r in plan:
        assert sorted(r) == list(range(n))                   # each setting once per round
    for pos in range(n):
        counts = [sum(r[pos] == s for r in plan) for s in range(n)]
        assert len(set(counts)) == 1                         # each position equally often
    if n > 1:
        pairs = {}
        for r in plan:
            for a, b in zip(r, r[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        assert len(pairs) == n * (n - 1)                     # every ordered pair adjacent
        assert len(set(pairs.values())) == 1                 # equally often


def test_a_plain_rotation_would_fail_the_predecessor_balance():
    """The oracle above is not vacuous: rotating one order keeps k+1 always after k."""
    n = 4
    rotation = [[(r + i) % n for i in range(n)] for r in range(n)]
    pairs = {(a, b) for r in rotation for a, b in zip(r, r[1:])}
    assert len(pairs) < n * (n - 1)
    assert timing.schedule(n, n) != rotation


def test_shuffle_is_seeded_and_a_permutation_each_round():
    a, b = timing.schedule(5, 6, "shuffle", seed=3), timing.schedule(5, 6, "shuffle", seed=3)
    assert a == b
    assert all(sorted(r) == list(range(5)) for r in a)
    assert len({tuple(r) for r in a}) > 1


@pytest.mark.parametrize("n,rounds,order", [(0, 3, "rotate"), (3, 0, "rotate"),
                                            (3, 3, "rotate")])
def test_bad_schedule_says_what(n, rounds, order):
    with pytest.raises(ValueError, match="schedule needs|order="):
        timing.schedule(n, rounds, order)


class FakeClock:
    """Time advances only inside steps, by what each step says (a slow phase multiplies it)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_interleave_runs_each_step_once_per_round_in_the_schedule_order():
    calls = []
    steps = {k: (lambda k=k: calls.append(k)) for k in ("plain", "a", "b")}
    t = timing.interleave(steps, rounds=3, baseline="plain", warmup=1)
    assert calls[:3] == ["plain", "a", "b"]                  # warm-up, first round's order
    rounds = [calls[3:6], calls[6:9], calls[9:12]]
    # schedule(3, 3): rows 0,1,2 / 1,2,0 / 2,0,1 of the Williams square (n odd: the next 3
    # rounds run them backwards)
    assert rounds == [["plain", "a", "b"], ["a", "b", "plain"], ["b", "plain", "a"]]
    assert t.orders == rounds
    assert all(len(v) == 3 for v in t.seconds.values())


def test_ratios_are_per_round_so_a_slow_round_cancels():
    clock = FakeClock()
    # round r runs at speed factor slow[r] (the shared machine); a costs 1.5x plain
    slow, cost = [1.0, 3.0, 1.0, 2.0], {"plain": 1.0, timing.CONTROL: 1.0, "a": 1.5}
    state = {"round": 0}
    cpu = FakeClock()                      # the CPU clock sees the work, not the slow phase

    def step(label):
        def run():
            clock.now += cost[label] * slow[state["round"]]
            cpu.now += cost[label]
        return run

    t = timing.interleave({k: step(k) for k in cost}, rounds=4, baseline="plain", clock=clock,
                          cpu_clock=cpu, on_round=lambda r, n: state.update(round=r))
    assert t.ratio("a").per_round == (1.5, 1.5, 1.5, 1.5)
    assert t.ratio("a").median == 1.5
    assert t.ratio(timing.CONTROL).median == 1.0
    assert t.summary()["control"]["time_ratio"] == 1.0
    # one after another (all of a in the slow rounds) would have read 1.5 * 2.5 / 1.0
    assert t.median_s("plain") == 1.5
    assert t.median_s("plain", "cpu") == 1.0
    assert t.ratio("a", clock="cpu").median == 1.5
    row = t.row("a")
    assert row["time_ratio"] == row["cpu_time_ratio"] == 1.5
    with pytest.raises(ValueError, match="clock='gpu'"):
        t.ratio("a", clock="gpu")


def test_ratio_quartiles_and_other_baseline():
    r = timing.Ratio.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (r.median, r.low, r.high) == (3.0, 2.0, 4.0)
    clock = FakeClock()
    cost = {"plain": 1.0, "long": 4.0, "x": 2.0}

    def step(label):
        def run():
            clock.now += cost[label]
        return run

    t = timing.interleave({k: step(k) for k in cost}, rounds=2, baseline="plain", clock=clock)
    assert t.ratio("x", against="long").median == 0.5


def test_unknown_baseline_is_a_clear_error():
    with pytest.raises(ValueError, match="baseline 'plain' is not one of"):
        timing.interleave({"a": lambda: None}, rounds=1, baseline="plain")
