"""DTR (``remat``) as a planner choice: its predicted bytes and time over a workload, against
the static plan's.

Note 1 (DTR on one batch). The plain step's trace is replayed under the budget by ``trace.dtr_sim``
(a replay of the live-bytes timeline with the blocks' evictable bytes): the peak it keeps, the
blocks it evicts. Each evicted block is recomputed once, at the start of its backward. The
simulation leaves out a recompute's transient bytes and chained recomputes, so to be priced like the
static plans DTR's time on a batch is that of the cheapest set of whole-block recomputes the memory
model finds under the same cap (search ``_best_for`` with keep / recompute only, the whole batch,
the optimizer as given: what DTR does with the blocks, chosen well), its peak the larger of the two
predictions; the runtime's bookkeeping (two hooks per block call, one pack per saved tensor) is left
out: ``benchmarks/dtr.py`` measures it within noise of the plain step on CPU. A batch neither
prediction fits under the cap makes DTR infeasible for the workload.

Note 2 (a workload). A static plan is made once, for the largest batch the job sees, and pays
its recompute / offload / micro-batches on every batch; DTR pays only where a batch is over the
budget. Over representative batches (e.g. a sample of a variable-length loader, the planned
batch the largest), the static plan's time is predicted as its step-time ratio times each
batch's plain time (its modes cost the same share of a shorter step: an approximation, the
same for every batch), and DTR's as Note 1 on each batch. DTR is chosen when its total is
below the static plan's by more than ``MARGIN`` (ties go to the static plan: its peak is
known before the run, and it needs no runtime bookkeeping). On one fixed batch the static
search, an exact MILP over per-block modes, is rarely beaten; on variable lengths DTR
usually is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.modes import Mode
from memfit.planner.memory_model import MemoryModel
from memfit.planner.plan import Plan
from memfit.planner.choice import Constraints
from memfit.planner.search import _best_for
from memfit.planner.time_model import TimeModel
from memfit.trace.dtr_sim import simulate_dtr, spans_from_modules

__all__ = ["MARGIN", "RematBatch", "remat_on", "remat_plan", "static_seconds"]

MARGIN = 0.01           # DTR must be predicted this much faster than the static plan (Note 2)


@dataclass(frozen=True)
class RematBatch:
    """DTR predicted on one batch of the workload (Note 1)."""

    plain_s: float              # the plain step's predicted seconds
    remat_s: float              # with DTR under the budget
    peak_bytes: int             # DTR's predicted live-bytes peak
    floor_bytes: int            # the least budget DTR can keep (all evictable bytes gone)
    evictions: int
    recompute_flops: int
    fits: bool                  # peak_bytes <= the cap


def remat_on(est, spec, precision: str, b: int, cap_bytes: int) -> RematBatch:
    """DTR on the plain trace ``est`` of ``b`` samples under ``cap_bytes`` allocated bytes
    (Note 1)."""
    memory = MemoryModel(est, b)
    time = TimeModel(est, spec, precision, b, memory)
    keep = (Mode.KEEP,) * len(memory.blocks)
    plain_s = time.step_s(b, b, keep, False)
    sim = simulate_dtr(est.timeline, spans_from_modules(est.modules, est.blocks), cap_bytes)
    only = Constraints(micro_batch_size=b, offload_optimizer=False,
                       modes={n: (Mode.KEEP, Mode.RECOMPUTE) for n in memory.blocks})
    found = _best_for(memory, time, (precision, None), b, b, False, cap_bytes, only)
    if found is False:                   # the static model sees no recompute set that fits
        return RematBatch(plain_s, float("inf"), sim.peak_bytes, sim.floor_bytes,
                          sim.evictions, sim.recompute_flops, False)
    peak = max(sim.peak_bytes, found.allocated_bytes)
    return RematBatch(plain_s, found.step_s, peak, sim.floor_bytes, sim.evictions,
                      sim.recompute_flops, sim.peak_bytes <= cap_bytes and peak <= cap_bytes)


def static_seconds(ratio: float, batches: list[RematBatch]) -> float:
    """The static plan's predicted seconds over the workload (Note 2)."""
    return float(ratio * np.sum([r.plain_s for r in batches]))


def remat_plan(knobs, rows: list[RematBatch], *, device: str, budget_bytes: int, b: int,
               held_bytes: int, device_ratio: float, context_bytes: int,
               reasons: list[str], optimizer_step_bytes: int | None = None):
    """The Plan that runs the step under DTR (Note 1), predicted over the workload ``rows``."""
    peak = max(r.peak_bytes for r in rows) + held_bytes
    reserved = int(peak * device_ratio)
    ratio = sum(r.remat_s for r in rows) / max(sum(r.plain_s for r in rows), 1e-12)
    return Plan(knobs, predicted_peak_bytes=peak, predicted_reserved_bytes=reserved,
                predicted_device_bytes=reserved + context_bytes,
                predicted_step_time_ratio=ratio, device=device, budget_bytes=budget_bytes,
                batch_size=b, predicted_optimizer_step_bytes=optimizer_step_bytes,
                reasons=reasons)
