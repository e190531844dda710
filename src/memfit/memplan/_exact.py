"""The exact arena of a small step: a mixed-integer program solved by HiGHS (scipy's ``milp``).

Note 1 (the model). Offsets ``x_i >= 0`` (continuous, in units of the sizes' gcd), the arena
``A``; for each pair ``i < j`` live at a common op point one binary ``z_ij``: ``z = 0`` puts
``i`` below ``j`` (``x_i + s_i <= x_j``), ``z = 1`` the other way, through big-M constraints
with ``M`` the greedy arena (a feasible layout, so the optimum is below it); ``x_i + s_i <= A``
and ``A >= `` the peak of live bytes. Minimise ``A``.

Note 2 (exact integers back). The solver's offsets are floats within its tolerances; only
its choice of which storage lies below which is kept. Offsets are then the longest paths in
that order (each storage as low as the ones below it allow), integers that are valid by
construction, with an arena no larger than the solver's (up to its tolerance).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import reduce

import numpy as np

__all__ = ["ExactResult", "exact_offsets"]


@dataclass(frozen=True)
class ExactResult:
    offsets: np.ndarray       # int64 bytes
    arena_bytes: int
    optimal: bool             # HiGHS proved it optimal (else: best found in the time limit)
    bound_bytes: int          # the solver's lower bound on the arena
    seconds: float
    pairs: int                # overlapping pairs (binary variables)


def exact_offsets(sizes: np.ndarray, first: np.ndarray, last: np.ndarray, upper_bytes: int,
                  lower_bytes: int, time_limit_s: float = 20.0) -> ExactResult:
    """Optimal offsets for storages ``sizes`` live at op points ``first..last`` (Note 1);
    ``upper_bytes``: the arena of a valid layout, ``lower_bytes``: the peak of live bytes."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n = len(sizes)
    start = time.perf_counter()
    if n == 0:
        return ExactResult(np.zeros(0, dtype=np.int64), 0, True, 0, 0.0, 0)
    unit = reduce(math.gcd, (int(s) for s in sizes))
    s = sizes.astype(np.float64) / unit
    big = upper_bytes / unit
    ii, jj = np.triu_indices(n, 1)
    overlap = (first[ii] <= last[jj]) & (first[jj] <= last[ii])
    ii, jj = ii[overlap], jj[overlap]
    m = len(ii)
    # variables: x_0..x_{n-1}, A, z_0..z_{m-1}
    a_col, z0 = n, n + 1
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = np.arange(m)
    for k, (sign_i, sign_j, sign_z, rhs_shift, size) in enumerate(((1, -1, -big, 0.0, s[ii]),
                                                                 (-1, 1, big, big, s[jj]))):
        base = k * m
        rows += [base + r, base + r, base + r]
        cols += [ii, jj, z0 + r]
        vals += [np.full(m, sign_i), np.full(m, sign_j), np.full(m, sign_z)]
        lo.append(np.full(m, -np.inf))
        hi.append(rhs_shift - size)
    base = 2 * m
    rows += [base + np.arange(n), base + np.arange(n)]
    cols += [np.arange(n), np.full(n, a_col)]
    vals += [np.ones(n), -np.ones(n)]
    lo.append(np.full(n, -np.inf))
    hi.append(-s)
    nv = n + 1 + m
    matrix = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                        shape=(2 * m + n, nv)).tocsr()
    c = np.zeros(nv)
    c[a_col] = 1.0
    lb = np.zeros(nv)
    ub = np.concatenate((big - s, [big], np.ones(m)))
    lb[a_col] = lower_bytes / unit
    integrality = np.concatenate((np.zeros(n + 1), np.ones(m)))
    res = milp(c, constraints=LinearConstraint(matrix, np.concatenate(lo), np.concatenate(hi)),
               integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": time_limit_s, "disp": False})
    seconds = time.perf_counter() - start
    if res.x is None:                       # nothing found in time: the greedy layout stands
        raise TimeoutError(f"HiGHS found no layout of {n} storages in {time_limit_s} s")
    z = np.rint(res.x[z0:]).astype(bool)
    offsets = _longest_paths(sizes, ii, jj, z)
    bound = getattr(res, "mip_dual_bound", None)
    bound_bytes = int(math.ceil((bound if bound is not None else lower_bytes / unit) * unit
                                - 1e-6 * unit))
    return ExactResult(offsets, int((offsets + sizes).max()), res.status == 0,
                       max(bound_bytes, lower_bytes), seconds, m)


def _longest_paths(sizes: np.ndarray, ii: np.ndarray, jj: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Lowest integer offsets honouring the order "lower below upper" of every pair (Note 2)."""
    n = len(sizes)
    lower = np.where(z, jj, ii)
    upper = np.where(z, ii, jj)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = np.zeros(n, dtype=np.int64)
    for a, b in zip(lower.tolist(), upper.tolist()):
        succ[a].append(b)
        indeg[b] += 1
    offsets = np.zeros(n, dtype=np.int64)
    ready = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while ready:
        a = ready.pop()
        seen += 1
        top = offsets[a] + sizes[a]
        for b in succ[a]:
            offsets[b] = max(offsets[b], top)
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    assert seen == n, "the solver's order has a cycle (infeasible within tolerance)"
    return offsets
