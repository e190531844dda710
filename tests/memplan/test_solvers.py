"""Greedy planners and the exact MILP on small graphs, against a brute-force optimum.

The oracle: for any layout, placing storages in the order of their offsets, each at the
lowest offset clear of those already placed, gives an arena no larger (each stays at or
below its old offset). So the minimum over every placement order of that rule is the
optimum; for 6 storages that is 720 orders, enumerated here.
"""

import itertools

import numpy as np
import pytest

from memfit.memplan import plan_lifetimes
from memfit.memplan._exact import exact_offsets
from memfit.memplan._greedy import arena_of, greedy_by_lifetime, greedy_by_size


def clashes(sizes, first, last, offsets) -> int:
    n, bad = len(sizes), 0
    for i, j in itertools.combinations(range(n), 2):
        if first[i] <= last[j] and first[j] <= last[i]:
            if offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]:
                bad += 1
    return bad


def brute_force_optimum(sizes, first, last) -> int:
    n, best = len(sizes), None
    overlap = [[first[i] <= last[j] and first[j] <= last[i] for j in range(n)] for i in range(n)]
    for order in itertools.permutations(range(n)):
        off = {}
        for i in order:
            for c in sorted({0, *(off[j] + sizes[j] for j in off if overlap[i][j])}):
                if all(not overlap[i][j] or c + sizes[i] <= off[j] or off[j] + sizes[j] <= c
                       for j in off):
                    off[i] = c
                    break
        arena = max(off[i] + sizes[i] for i in off)
        best = arena if best is None else min(best, arena)
    return best


def lower_bound(sizes, first, last) -> int:
    return max(sum(int(s) for s, f, l in zip(sizes, first, last) if f <= t <= l)
               for t in range(int(first.min()), int(last.max()) + 1))


def test_hand_checked_case_where_greedy_by_size_misses_the_optimum():
    # A: 3 B at ops 2-3, B: 3 B at 0-1, C: 3 B at 3-5, D: 2 B at 0-2. Live bytes: 5 5 5 6 3 3,
    # so nothing beats 6; A at 0, B at 0, C at 3, D at 3 reaches it (D meets B at 0-1 and A
    # at 2; C meets A at 3). Greedy by size puts the 3-byte storages first: C (longest) at 0,
    # B at 0, A above C at 3, and D, meeting both B (0-3) and A (3-6), goes on top: 8.
    sizes, first, last = (np.array(v) for v in ([3, 3, 3, 2], [2, 0, 3, 0], [3, 1, 5, 2]))
    assert lower_bound(sizes, first, last) == 6
    assert arena_of(sizes, greedy_by_size(sizes, first, last)) == 8
    ex = exact_offsets(sizes, first, last, upper_bytes=8, lower_bytes=6)
    assert ex.optimal and ex.arena_bytes == 6 == brute_force_optimum(sizes, first, last)
    assert clashes(sizes, first, last, ex.offsets) == 0


@pytest.mark.parametrize("seed", range(6))
def test_exact_is_the_optimum_and_no_worse_than_greedy(seed):
    rng = np.random.default_rng(seed)
    n = 6
    sizes = rng.integers(1, 6, n) * 512
    first = rng.integers(0, 6, n)
    last = first + rng.integers(0, 4, n)
    by_size = greedy_by_size(sizes, first, last)
    by_life = greedy_by_lifetime(sizes, first, last)
    assert clashes(sizes, first, last, by_size) == clashes(sizes, first, last, by_life) == 0
    greedy = min(arena_of(sizes, by_size), arena_of(sizes, by_life))
    lb = lower_bound(sizes, first, last)
    ex = exact_offsets(sizes, first, last, upper_bytes=greedy, lower_bytes=lb)
    assert clashes(sizes, first, last, ex.offsets) == 0
    assert ex.optimal
    assert lb <= ex.arena_bytes == brute_force_optimum(sizes, first, last) <= greedy


def test_plan_lifetimes_stacks_storages_alive_throughout_at_the_bottom():
    sizes = np.array([100, 7, 3, 5])
    first, last = np.array([-1, 0, 1, -1]), np.array([4, 1, 4, 4])
    offsets, method, by_size, by_life, exact, lb = plan_lifetimes(sizes, first, last, 5)
    assert sorted(offsets[[0, 3]].tolist()) == [0, 100]
    assert min(offsets[[1, 2]]) >= 105 and clashes(sizes, first, last, offsets) == 0
    assert lb == 105 + 10 and arena_of(sizes, offsets) == lb


def test_plan_lifetimes_takes_the_better_greedy():
    sizes, first, last = (np.array(v) for v in ([3, 3, 3, 2, 9], [2, 0, 3, 0, -1],
                                                [3, 1, 5, 2, 5]))
    offsets, method, by_size, by_life, exact, lb = plan_lifetimes(sizes, first, last, 6)
    assert lb == 15 and arena_of(sizes, offsets) == 15
    assert clashes(sizes, first, last, offsets) == 0
    assert by_size == 17        # the 9-byte storage below, the hand-checked case above it
    assert method == "greedy-by-lifetime" and by_life == 15 and exact is None
