"""One traced step as the report draws it: the verdict's curve per op, by category, with what
each op was, and a downsampling that keeps the exact peak.

Note 1 (which curve). With the trace's record (``report._capture``) the curve is the allocated bytes
the verdict's peak is taken from (``report._replay``'s op-by-op replay): on a GPU target the
allocator's blocks, whose maximum is ``est.peak_bytes``. Without it, on a GPU target, the curve is
the live tensor bytes, and ``exact`` is False: the report says so beside the curve.

Note 2 (downsampling). A step has up to ~10^5 ops and a plot ~10^3 columns. The ops are cut
into ``MAX_POINTS`` runs and each run is drawn at its highest op (``envelope``), with that
op's split by category, so the drawn maximum is the true one and the peak op is a drawn point.

Note 3 (held beside the step). A plan counts bytes of the caller's batch that the runner keeps alive
but the traced step does not use (e.g. an all-ones attention mask, dropped from the traced batch but
still held by the caller; ``predicted_peak_bytes`` = the trace's peak + them). They are alive all
along: drawn as inputs at every op, so the curve's maximum is the plan's predicted peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.measure import CATEGORIES
from memfit.report._ops import OpInfo, annotate
from memfit.report._replay import replay
from memfit.units import format_bytes

__all__ = ["StepView", "step_view", "downsample", "envelope", "MAX_POINTS"]

MAX_POINTS = 2000


def envelope(timeline: list[int], buckets: int) -> list[int]:
    """Index of the highest op of each of ``buckets`` runs of ops, so a one-op peak survives
    downsampling (Note 2); every op if there are few."""
    n = len(timeline)
    if n <= buckets:
        return list(range(n))
    out = []
    for j in range(buckets):
        lo, hi = j * n // buckets, (j + 1) * n // buckets
        out.append(max(range(lo, hi), key=timeline.__getitem__))
    return out


@dataclass
class StepView:
    est: object                          # the Estimate
    label: str                           # "plain step", "with the plan", ...
    allocated: list[int]                 # per op: the verdict's allocated bytes (Note 1)
    by_category: dict[str, list[int]]
    exact: bool                          # allocated's maximum is est.peak_bytes (Note 1)
    info: OpInfo
    context_bytes: int                   # outside the allocator (GPU target), drawn below
    held_bytes: int = 0                  # alive beside the traced step all along (Note 3),
                                         # already in allocated and by_category["inputs"]

    @property
    def peak_op(self) -> int:
        return max(range(len(self.allocated)), key=self.allocated.__getitem__)

    @property
    def peak_bytes(self) -> int:
        return self.allocated[self.peak_op]

    def hover(self, i: int) -> str:
        """What op ``i`` was and what was live after it, in words, with exact bytes."""
        info = self.info
        mb = f", micro-batch {info.micro_batch[i]}" if info.micro_batch[i] else ""
        parts = [f"op {i}: {info.op[i]}", f"module {info.module[i] or '(root)'}",
                 f"phase {info.phase[i]}{mb}",
                 f"allocated {format_bytes(self.allocated[i])} ({self.allocated[i]} B)"]
        parts += [f"  {c}: {format_bytes(self.by_category[c][i])}" for c in CATEGORIES
                  if self.by_category[c][i]]
        return "<br>".join(parts)


def step_view(est, tracker=None, *, label: str = "", allocator=None,
              held_bytes: int = 0) -> StepView:
    """The view of ``est``; ``tracker``: its trace's record (``report._capture.traced``);
    ``held_bytes``: the caller's bytes alive beside the step (Note 3)."""
    cuda = est.basis == "cuda-model"
    if tracker is not None:
        r = replay(est, tracker, allocator=allocator)
        allocated, by_cat, exact = r.allocated, r.by_category, True
    else:
        allocated, by_cat, exact = list(est.timeline), dict(est.timeline_by_category), not cuda
    if held_bytes:
        allocated = [v + held_bytes for v in allocated]
        by_cat = {**by_cat, "inputs": [v + held_bytes for v in by_cat["inputs"]]}
    return StepView(est, label, allocated, by_cat, exact, annotate(est),
                    est.context_bytes if cuda else 0, held_bytes)


def downsample(values: list[int], max_points: int = MAX_POINTS) -> list[int]:
    """Op indices to draw (Note 2): each run's highest op (``envelope``), the last op."""
    picks = envelope(values, max_points)
    if picks and picks[-1] != len(values) - 1:
        picks.append(len(values) - 1)
    return picks
