"""The planner's search: the fastest predicted configuration whose predicted bytes fit.

Note 1 (what is searched). Precision (the candidates the caller passes) x micro-batch size
(1..b) x optimizer-state offload x one mode per block (``memory_model.MODES``). For each outer
choice the per-block modes are a small MILP, solved exactly with scipy's HiGHS: binary x[i, mode],
one mode per block, minimise the time the modes add (time_model Note 4) subject to every
candidate peak point (memory_model Note 4) <= the cap. Keeping every block, when it fits, is
optimal (no mode is faster than keep), so the MILP runs only where that does not fit.
Bytes enter the MILP in MiB and times in milliseconds, to keep HiGHS well scaled.

Ties (the same predicted time, e.g. micro-batches 4 and 6 of 8 both run two) go to the
smallest micro-batch: the least memory, and chunks as even as they can be.

Note 2 (pruning). Among micro-batches that accumulate (``m < b``) memory grows with ``m``, so
once even the least-memory modes do not fit at some ``m < b``, no larger ``m < b`` does; the
search then tries ``m = b`` alone. That one can need *less* than ``m = 1``: without accumulation
no gradient is alive during the forward (memory_model Note 5). The floor is therefore the lesser
of ``m = 1`` and ``m = b``.
"""

from __future__ import annotations

from dataclasses import dataclass

import itertools

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from memfit.planner.memory_model import MODES, MemoryModel
from memfit.planner.time_model import TimeModel

__all__ = ["Choice", "Constraints", "search", "floor"]

_MIB = float(2 ** 20)


@dataclass(frozen=True)
class Choice:
    """One configuration and what the models predict for it."""

    precision: str
    micro_batch_size: int
    modes: tuple[str, ...]           # per block, in execution order
    offload_optimizer: bool
    allocated_bytes: int             # predicted allocated peak
    device_bytes: int                # predicted device bytes (memory_model Note 6)
    step_s: float                    # predicted step time


@dataclass(frozen=True)
class Constraints:
    """What the user fixed (``None``: free)."""

    micro_batch_size: int | None = None
    modes: tuple[str, ...] | None = None          # per block
    offload_optimizer: bool | None = None


def _bounds(model: MemoryModel, fixed: Constraints) -> tuple[np.ndarray, np.ndarray]:
    """Per variable lower/upper bounds: a mode a block cannot take, or the user's fixed mode."""
    nm = len(MODES)
    lo = np.zeros(len(model.blocks) * nm)
    hi = np.zeros(len(model.blocks) * nm)
    for i in range(len(model.blocks)):
        allowed = model.allowed(i) if fixed.modes is None else (fixed.modes[i],)
        for j, mode in enumerate(MODES):
            if mode in allowed:
                hi[i * nm + j] = 1.0
        if fixed.modes is not None:
            lo[i * nm + MODES.index(fixed.modes[i])] = 1.0
    return lo, hi


def _solve(c: np.ndarray, A: np.ndarray, ub: np.ndarray, lo, hi, nblocks: int):
    nm = len(MODES)
    if nblocks == 0:
        return None
    cons = [LinearConstraint(_one_mode_per_block(nblocks, nblocks * nm), 1.0, 1.0)]
    if len(A):
        cons.append(LinearConstraint(A, -np.inf, ub))
    res = milp(c, constraints=cons, integrality=np.ones_like(c), bounds=Bounds(lo, hi))
    if res.x is None:
        return None
    return np.round(res.x)


def _one_mode_per_block(nblocks: int, columns: int) -> np.ndarray:
    """Rows that sum each block's mode variables (block-major, ``MODES`` order): each == 1."""
    nm = len(MODES)
    rows = np.zeros((nblocks, columns))
    for i in range(nblocks):
        rows[i, i * nm:(i + 1) * nm] = 1.0
    return rows


def _modes_of(x: np.ndarray, nblocks: int) -> tuple[str, ...]:
    nm = len(MODES)
    return tuple(MODES[int(np.argmax(x[i * nm:(i + 1) * nm]))] for i in range(nblocks))


def _best_for(memory: MemoryModel, time: TimeModel, precision: str, m: int, b: int,
              oo: bool, cap_bytes: float, fixed: Constraints) -> Choice | None | bool:
    """The fastest modes at (precision, m, oo) under ``cap_bytes`` allocated; ``False`` when
    even the least-memory modes do not fit (Note 2)."""
    nb, nm = len(memory.blocks), len(MODES)
    rows = memory.rows(m, b, accumulate=m < b, offload_optimizer=oo)
    lo, hi = _bounds(memory, fixed)
    n = -(-b // m)
    cost = np.array([time.mode_s(i, mode, m, n, b) for i in range(nb) for mode in MODES])
    keep = np.zeros(nb * nm)
    keep[[i * nm for i in range(nb)]] = 1.0
    if fixed.modes is None and rows.peak(keep) <= cap_bytes:
        x = keep
    else:
        x = _solve(cost * 1e3, rows.A / _MIB, (cap_bytes - rows.const) / _MIB, lo, hi, nb)
        if x is None:
            return False
        if rows.peak(x) > cap_bytes * (1 + 1e-9):      # rounding of a near-integral answer
            return False
    return _choice(memory, time, precision, m, b, oo, rows.peak(x), _modes_of(x, nb))


def _choice(memory, time, precision, m, b, oo, allocated, modes) -> Choice:
    return Choice(precision, m, modes, oo, int(allocated), memory.device_bytes(allocated),
                  time.step_s(m, b, modes, oo))


def search(models: dict[str, tuple[MemoryModel, TimeModel]], b: int, budget_bytes: int,
           fixed: Constraints = Constraints(), margins: dict[str, int] | None = None
           ) -> Choice | None:
    """The fastest ``Choice`` predicted to fit ``budget_bytes`` device bytes (Note 1), or None.
    ``margins``: per precision, bytes to take off the cap (what verification found missing)."""
    best = None
    for precision, (memory, time) in models.items():
        cap_device = budget_bytes - memory.context_bytes - (margins or {}).get(precision, 0)
        cap = cap_device / memory.device_ratio
        sizes = [min(fixed.micro_batch_size, b)] if fixed.micro_batch_size \
            else list(range(1, b + 1))
        places = [fixed.offload_optimizer] if fixed.offload_optimizer is not None \
            else [False, True]
        for oo in places:
            for m in sizes:
                found = _best_for(memory, time, precision, m, b, oo, cap, fixed)
                if found is False and m < b and b in sizes:     # Note 2: only m = b is left
                    found = _best_for(memory, time, precision, b, b, oo, cap, fixed)
                if found is False:
                    break
                if best is None or found.step_s < best.step_s:
                    best = found
                if found.micro_batch_size == b:
                    break
    return best


def floor(models: dict[str, tuple[MemoryModel, TimeModel]], b: int,
          fixed: Constraints = Constraints()) -> Choice:
    """The configuration with the fewest predicted device bytes anywhere in the space."""
    best = None
    for precision, (memory, time) in models.items():
        nb, nm = len(memory.blocks), len(MODES)
        sizes = [min(fixed.micro_batch_size, b)] if fixed.micro_batch_size else sorted({1, b})
        for m, oo in itertools.product(sizes, [fixed.offload_optimizer]
                                       if fixed.offload_optimizer is not None else [True, False]):
            rows = memory.rows(m, b, accumulate=m < b, offload_optimizer=oo)
            lo, hi = _bounds(memory, fixed)
            if nb == 0:
                choice = _choice(memory, time, precision, m, b, oo, rows.peak(np.zeros(0)), ())
                if best is None or choice.device_bytes < best.device_bytes:
                    best = choice
                continue
            # minimise z subject to const + A x <= z (bytes in MiB)
            c = np.zeros(nb * nm + 1)
            c[-1] = 1.0
            A = np.hstack([rows.A / _MIB, -np.ones((len(rows.const), 1))])
            one_hot = _one_mode_per_block(nb, nb * nm + 1)
            integrality = np.r_[np.ones(nb * nm), 0.0]
            res = milp(c, constraints=[LinearConstraint(one_hot, 1.0, 1.0),
                                       LinearConstraint(A, -np.inf, -rows.const / _MIB)],
                       integrality=integrality,
                       bounds=Bounds(np.r_[lo, -np.inf], np.r_[hi, np.inf]))
            x = np.round(res.x[:-1])
            choice = _choice(memory, time, precision, m, b, oo, rows.peak(x), _modes_of(x, nb))
            if best is None or choice.device_bytes < best.device_bytes:
                best = choice
    return best
