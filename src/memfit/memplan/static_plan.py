"""``memfit.memplan.static_plan``: one arena for the whole step, planned from lifetimes (SOMAS).

Note 1 (sizes). A CUDA estimate's storages are planned at the caching allocator's block size
(``round_size``: 512 B) with the cuBLAS workspaces as two more storages alive throughout, so
the lower bound is the estimate's allocated peak and the arena is comparable with its reserved
bytes. A CPU estimate plans the storages' own bytes (``align_bytes=1``), so the lower bound is
the peak ``track`` measures.

Note 2 (what is planned). The counted step's window (its op points, ``_lifetimes``), as a line: a
storage alive at the window's start is placed from point -1, one alive at its end to the last point.
A replay of many steps would also need the storages alive at the end (the new gradients) to sit
where the next step's entry storages are; that cyclic constraint is not imposed here (the gradients
are the only such storages of the canonical step).

Note 3 (figures). ``lower_bound_bytes`` is the peak of live bytes at op points; no layout beats it.
``arena_bytes`` is the best of the greedy planners (``_greedy``: by size, TFLite's; by lifetime,
tinygrad's) and, for a step of at most ``exact_max_storages`` storages to plan where the greedy
layouts miss the lower bound, HiGHS's exact layout (``_exact``). ``reserved_bytes`` is what the
caching allocator would reserve at its peak for the same storages (the estimate's own figure on a
GPU, the model's replay for a CPU one, ``_pools``). The arena is what a static plan would need;
``reserved - arena`` is the fragmentation it removes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memfit.measure._ledger import CATEGORIES
from memfit.memplan._exact import ExactResult, exact_offsets
from memfit.memplan._greedy import arena_of, greedy_by_lifetime, greedy_by_size, pinned_mask
from memfit.memplan._lifetimes import step_lifetimes
from memfit.memplan._pools import allocator_options, default_reserved, workspaces
from memfit.trace._allocator_blocks import K_MIN_BLOCK_SIZE

__all__ = ["Assignment", "StaticPlan", "static_plan", "plan_lifetimes", "step_lifetimes"]


@dataclass(frozen=True)
class Assignment:
    """One storage's place in the arena. Bytes; ops are the step's timeline indices."""

    offset: int
    size: int
    first_op: int             # first op point it is live at (-1: alive when the step starts)
    last_op: int              # last op point it is live at
    category: str = "other"


@dataclass
class StaticPlan:
    """A static layout of the step's storages in one arena (module Notes)."""

    arena_bytes: int          # the best layout's arena
    lower_bound_bytes: int    # peak of live bytes (Note 3)
    reserved_bytes: int       # the caching allocator's reserved peak for the same step
    assignments: list[Assignment]
    greedy_by_size_bytes: int
    greedy_by_lifetime_bytes: int
    exact: ExactResult | None = None     # HiGHS's layout, for a small step
    method: str = "greedy-by-size"       # which layout ``assignments`` is
    align_bytes: int = 1
    num_ops: int = 0
    pools: object | None = None          # ``memplan.allocator_options``' result, if asked for
    notes: list[str] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        """Bytes the arena saves against the caching allocator's reservation (0 if none)."""
        return max(0, self.reserved_bytes - self.arena_bytes)

    @property
    def gap_closed(self) -> float:
        """Share of the reserved-minus-lower-bound gap the arena closes (1.0: all of it)."""
        gap = self.reserved_bytes - self.lower_bound_bytes
        return 1.0 if gap <= 0 else (self.reserved_bytes - self.arena_bytes) / gap

    def to_dict(self, assignments: bool = False) -> dict:
        out = {"arena_bytes": self.arena_bytes, "lower_bound_bytes": self.lower_bound_bytes,
               "reserved_bytes": self.reserved_bytes, "saved_bytes": self.saved_bytes,
               "gap_closed": round(self.gap_closed, 4), "method": self.method,
               "greedy_by_size_bytes": self.greedy_by_size_bytes,
               "greedy_by_lifetime_bytes": self.greedy_by_lifetime_bytes,
               "storages": len(self.assignments), "align_bytes": self.align_bytes,
               "exact": None if self.exact is None else {
                   "arena_bytes": self.exact.arena_bytes, "optimal": self.exact.optimal,
                   "bound_bytes": self.exact.bound_bytes, "seconds": round(self.exact.seconds, 3),
                   "pairs": self.exact.pairs},
               "notes": list(self.notes)}
        if self.pools is not None:
            out["allocator_options"] = self.pools.to_dict()
        if assignments:
            out["assignments"] = [a.__dict__ for a in self.assignments]
        return out


def plan_lifetimes(sizes: np.ndarray, first: np.ndarray, last: np.ndarray, num_ops: int, *,
                   exact_max_storages: int = 40, time_limit_s: float = 10.0):
    """Offsets for storages ``sizes`` live at ``first..last``: (offsets, method, by-size arena,
    by-lifetime arena, exact result or None, lower bound). Storages alive throughout are
    stacked at the bottom: the optimum is their sum plus the rest's, exactly."""
    lower = int(_live(sizes, first, last, num_ops).max()) if len(sizes) else 0
    pin = pinned_mask(first, last, num_ops)
    pin_idx, rest = np.flatnonzero(pin), np.flatnonzero(~pin)
    offsets = np.zeros(len(sizes), dtype=np.int64)
    offsets[pin_idx] = np.concatenate(([0], np.cumsum(sizes[pin_idx])[:-1])) \
        if len(pin_idx) else []
    base = int(sizes[pin_idx].sum())
    s, f, l = sizes[rest], first[rest], last[rest]
    candidates = {"greedy-by-size": greedy_by_size(s, f, l),
                  "greedy-by-lifetime": greedy_by_lifetime(s, f, l)}
    arenas = {k: arena_of(s, v) for k, v in candidates.items()}
    method = min(arenas, key=lambda k: (arenas[k], k != "greedy-by-size"))
    exact = None
    if 0 < len(rest) <= exact_max_storages and arenas[method] + base > lower:
        rest_lower = max(0, lower - base)
        exact = exact_offsets(s, f, l, arenas[method], rest_lower, time_limit_s)
        exact = ExactResult(exact.offsets + base, exact.arena_bytes + base, exact.optimal,
                            exact.bound_bytes + base, exact.seconds, exact.pairs)
        if exact.arena_bytes - base < arenas[method]:
            candidates["exact"], arenas["exact"], method = exact.offsets - base, \
                exact.arena_bytes - base, "exact"
    offsets[rest] = candidates[method] + base
    return (offsets, method, arenas["greedy-by-size"] + base,
            arenas["greedy-by-lifetime"] + base, exact, lower)


def _live(sizes, first, last, num_ops) -> np.ndarray:
    diff = np.zeros(num_ops + 2, dtype=np.int64)
    np.add.at(diff, first + 1, sizes)
    np.add.at(diff, last + 2, -sizes)
    return np.cumsum(diff)[:-1]


def static_plan(estimate, *, align_bytes: int | None = None, exact_max_storages: int = 40,
                time_limit_s: float = 10.0, pools: bool = False) -> StaticPlan:
    """Plan the storages of ``estimate``'s step (a ``memfit.estimate`` result, or a real run's
    finished ``memfit.track`` region: CPU figures) in one arena.

    ``align_bytes``: storages' sizes are rounded up to it (default: 512 for a GPU estimate, the
    caching allocator's block; 1 on the CPU, Note 1). ``exact_max_storages``: steps with at most
    this many storages to plan (those not alive throughout) are also solved exactly with HiGHS,
    within ``time_limit_s``, unless a greedy layout already reaches the lower bound.
    ``pools=True`` also predicts the allocator settings (``allocator_options``) into ``.pools``.
    """
    log, life = step_lifetimes(estimate)
    cuda = getattr(estimate, "basis", "cpu-trace") == "cuda-model"
    align = align_bytes if align_bytes is not None else (K_MIN_BLOCK_SIZE if cuda else 1)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align_bytes must be an int >= 1, got {align_bytes!r}")
    if not isinstance(exact_max_storages, int) or exact_max_storages < 0:
        raise ValueError(f"exact_max_storages must be an int >= 0, got {exact_max_storages!r}")

    ws = workspaces(estimate)
    n_ops = life.num_ops
    sizes = np.concatenate((-(-life.nbytes // align) * align, np.asarray(ws, dtype=np.int64)))
    first = np.concatenate((life.first_op, np.full(len(ws), -1, dtype=np.int64)))
    last = np.concatenate((life.last_op, np.full(len(ws), n_ops - 1, dtype=np.int64)))
    cats = [CATEGORIES[int(c)] for c in life.category] + ["other"] * len(ws)
    offsets, method, by_size, by_life, exact, lower = plan_lifetimes(
        sizes, first, last, n_ops, exact_max_storages=exact_max_storages,
        time_limit_s=time_limit_s)
    assignments = [Assignment(int(o), int(s), int(f), int(l), c)
                   for o, s, f, l, c in zip(offsets, sizes, first, last, cats)]
    reserved = int(estimate.reserved_bytes) if cuda else default_reserved(estimate)
    notes = []
    if not cuda:
        notes.append("reserved_bytes on a CPU estimate: the caching-allocator model replaying "
                     "this step's storages as a GPU would (modelled, not the CPU's own figure)")
    arena = arena_of(sizes, offsets)
    if arena == lower:
        notes.append("the arena equals the lower bound: the layout is optimal")
    plan = StaticPlan(arena, lower, reserved, assignments, by_size, by_life,
                      exact, method, align, n_ops, notes=notes)
    if pools:
        plan.pools = allocator_options(estimate)
    return plan
