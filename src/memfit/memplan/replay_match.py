"""The matching logic of a replay allocator: serve a step's allocations from a static plan.

Note 1 (what a replay allocator does). A CUDA pluggable allocator
(``torch.cuda.memory.CUDAPluggableAllocator``) receives ``malloc(size)`` and ``free(ptr)``,
nothing else. In steady state every step makes the same allocations in the same order, so the
``k``-th malloc of a step is the ``k``-th storage born in the plan: if its size is the planned
one it gets the planned offset in the arena (a hit), else the fallback (``cudaMalloc``) serves
it (a miss, counted), and so does every allocation past the plan's end. A hit's block is
released at its free. Frees out of the plan's order could leave a planned block still held when
it is wanted again: that allocation is a conflict, served by the fallback. This module is that
logic, in Python, without CUDA (the spec); ``memplan.replay_allocator`` is the C++ side, which a
CPU build of torch cannot load (``torch._C._cuda_customAllocator`` does not exist there).

Note 2 (storages alive when the step starts). Parameters, optimizer state and the previous
step's gradients are not allocated by the step; only storages born during it (``first_op >=
0``) are expected, in birth order (``expected_allocations``, which the C++ side is given too).

Note 3 (the C++ mirror). ``_replay_alloc.cpp`` is this class in C++ behind the
``CUDAPluggableAllocator`` ABI (``memplan.replay_allocator``): the same order of checks (past the
plan, size, conflict), the same rounding, and a 0-byte request served outside the plan,
uncounted. Its host build is held to this class's counts on a real step
(tests/memplan/test_replay_alloc_core.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ReplayMatcher", "MatchStats", "expected_allocations"]


@dataclass
class MatchStats:
    hits: int = 0
    misses: int = 0               # a size different from the plan's next storage
    conflicts: int = 0            # the planned block is still held (frees came out of order)
    beyond_plan: int = 0          # allocations after the plan's last one
    miss_sizes: list[int] = field(default_factory=list)


def expected_allocations(plan) -> list[tuple[int, int]]:
    """(size, offset) of each storage the step allocates, in birth order (Note 2)."""
    born = [a for a in plan.assignments if a.first_op >= 0]
    return [(a.size, a.offset) for a in sorted(born, key=lambda a: a.first_op)]


class ReplayMatcher:
    """Maps each step's mallocs onto a ``StaticPlan``'s offsets (Note 1)."""

    def __init__(self, plan, align_bytes: int | None = None):
        self._expected = expected_allocations(plan)                       # Note 2
        self.align = align_bytes if align_bytes is not None else plan.align_bytes
        self.stats = MatchStats()
        self._cursor = 0
        self._live: dict[int, tuple[int, int]] = {}      # handle -> (offset, size), hits only
        self._next_handle = 0

    def begin_step(self) -> None:
        """A new step starts: the next malloc is the plan's first."""
        self._cursor = 0

    def malloc(self, nbytes: int) -> tuple[int, int | None]:
        """(handle, offset in the arena, or None for a miss the caching allocator serves)."""
        size = -(-nbytes // self.align) * self.align
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        if nbytes == 0:                   # outside the plan, uncounted (Note 3)
            return handle, None
        if self._cursor >= len(self._expected):
            self.stats.beyond_plan += 1
            return handle, None
        want, offset = self._expected[self._cursor]
        self._cursor += 1
        if size != want:
            self.stats.misses += 1
            self.stats.miss_sizes.append(nbytes)
            return handle, None
        if any(offset < o + s and o < offset + size for o, s in self._live.values()):
            self.stats.conflicts += 1
            return handle, None
        self._live[handle] = (offset, size)
        self.stats.hits += 1
        return handle, offset

    def free(self, handle: int) -> None:
        self._live.pop(handle, None)
