"""planner.search Notes 7-8: the bound before the MILP never refuses what fits, and the node
limit keeps every answer feasible.

Oracle: every one-hot assignment of a small random instance, enumerated (4 blocks x 4 modes:
256 assignments)."""

import itertools

import numpy as np
import pytest

from memfit.planner.memory_model import MODES, Rows
from memfit.planner.search import _lower_bound, _solve


def _instance(seed: int):
    rng = np.random.default_rng(seed)
    nb, nm, points = 4, len(MODES), 6
    A = rng.integers(0, 100, size=(points, nb * nm)).astype(float)
    const = rng.integers(0, 50, size=points).astype(float)
    hi = np.ones(nb * nm)
    hi[rng.integers(0, nb * nm, size=3)] = 0.0          # a few modes a block cannot take
    for i in range(nb):                                  # every block keeps one mode at least
        hi[i * nm] = 1.0
    return Rows(const, A, ["p"] * points), hi, nb, nm


def _assignments(hi, nb, nm):
    for modes in itertools.product(range(nm), repeat=nb):
        x = np.zeros(nb * nm)
        x[[i * nm + j for i, j in enumerate(modes)]] = 1.0
        if all(hi[i * nm + j] for i, j in enumerate(modes)):
            yield x


@pytest.mark.parametrize("seed", range(8))
def test_bound_is_the_least_peak_and_the_milp_fits(seed):
    rows, hi, nb, nm = _instance(seed)
    peaks = [rows.peak(x) for x in _assignments(hi, nb, nm)]
    least = min(peaks)
    bound = _lower_bound(rows, hi, nb)
    assert bound <= least                                # necessary: never refuses a fit
    cost = np.random.default_rng(seed + 100).random(nb * nm)
    for cap in sorted(set(peaks))[:: max(len(set(peaks)) // 5, 1)]:
        x = _solve(cost, rows.A, cap - rows.const, np.zeros(nb * nm), hi, nb)
        best = min((cost @ y for y in _assignments(hi, nb, nm) if rows.peak(y) <= cap))
        assert x is not None and rows.peak(x) <= cap + 1e-9
        assert cost @ x == pytest.approx(best)          # small instances: within the limit
