"""Greedy offset assignment: storages with op-point intervals -> offsets in one arena.

Note 1 (the problem). Each storage ``i`` has ``size[i]`` bytes and is live at op points
``first[i]..last[i]``; an offset ``x[i]`` must keep ``[x[i], x[i] + size[i])`` apart from every
storage live at a common point. The arena is ``max(x + size)``. This is dynamic storage
allocation (NP-hard in general); the peak of live bytes bounds it from below.

Note 2 (storages alive throughout). A storage live at every point overlaps every other in
time, so in any valid layout no other storage touches its byte range: cutting that range out
and shifting what lies above it down gives a valid layout of the others, and conversely. So
the optimum is their sum plus the optimum of the rest, exactly: they are stacked at the
bottom (parameters, optimizer state) and only the rest is planned.

Note 3 (by size). TFLite's ``GreedyBySizePlanner`` (Pisarchyk & Lee 2020, "Efficient Memory
Management for Deep Neural Net Inference"): largest first (ties: longer lifetime, earlier
birth); each takes the smallest gap between storages already placed that overlap it in time
where it fits, else the lowest offset above them all.

Note 4 (by lifetime). tinygrad's planner (``schedule/memory.py``): walk the op points in
order, free what died, then place what is born (largest first) in the best-fitting free gap of
the arena, else on top. An online allocator with perfect knowledge of sizes, no rounding to
segments and coalescing of neighbours: what a replay allocator would do.
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["greedy_by_size", "greedy_by_lifetime", "arena_of", "pinned_mask"]


def arena_of(sizes: np.ndarray, offsets: np.ndarray) -> int:
    return int((offsets + sizes).max()) if len(sizes) else 0


def pinned_mask(first: np.ndarray, last: np.ndarray, num_ops: int) -> np.ndarray:
    """Storages live at every op point -1..num_ops-1 (Note 2)."""
    return (first <= -1) & (last >= num_ops - 1)


def greedy_by_size(sizes: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Offsets by TFLite's greedy-by-size (Note 3)."""
    n = len(sizes)
    order = np.lexsort((first, -(last - first), -sizes))
    offsets = np.zeros(n, dtype=np.int64)
    p_first = np.empty(n, dtype=np.int64)
    p_last = np.empty(n, dtype=np.int64)
    p_off = np.empty(n, dtype=np.int64)
    p_end = np.empty(n, dtype=np.int64)
    k = 0
    for i in order:
        size, f, l = int(sizes[i]), first[i], last[i]
        hit = np.flatnonzero((p_first[:k] <= l) & (p_last[:k] >= f))
        off = 0
        if len(hit):
            o = np.argsort(p_off[hit], kind="stable")
            offs, ends = p_off[hit][o], p_end[hit][o]
            prev_end = np.concatenate(([0], np.maximum.accumulate(ends)[:-1]))
            gaps = offs - prev_end
            fits = np.flatnonzero(gaps >= size)
            if len(fits):
                off = int(prev_end[fits[np.argmin(gaps[fits])]])
            else:
                off = int(ends.max())
        offsets[i] = off
        p_first[k], p_last[k], p_off[k], p_end[k] = f, l, off, off + size
        k += 1
    return offsets


class _FreeList:
    """Free gaps of an arena that grows on top, kept sorted by offset and coalesced."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.top = 0

    def alloc(self, size: int) -> int:
        best, best_len = -1, None
        for j, (s, e) in enumerate(zip(self.starts, self.ends)):
            if e - s >= size and (best_len is None or e - s < best_len):
                best, best_len = j, e - s
        if best >= 0:
            s = self.starts[best]
            if best_len == size:
                del self.starts[best], self.ends[best]
            else:
                self.starts[best] = s + size
            return s
        if self.ends and self.ends[-1] == self.top:     # a free gap at the top: grow from it
            s = self.starts.pop()
            self.ends.pop()
        else:
            s = self.top
        self.top = s + size
        return s

    def free(self, off: int, size: int) -> None:
        end = off + size
        j = bisect.bisect_left(self.starts, off)
        if j > 0 and self.ends[j - 1] == off:           # merge with the gap below
            j -= 1
            off = self.starts[j]
            del self.starts[j], self.ends[j]
        if j < len(self.starts) and self.starts[j] == end:   # and with the one above
            end = self.ends[j]
            del self.starts[j], self.ends[j]
        self.starts.insert(j, off)
        self.ends.insert(j, end)


def greedy_by_lifetime(sizes: np.ndarray, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Offsets by walking the op points with a best-fit free list (Note 4)."""
    n = len(sizes)
    offsets = np.zeros(n, dtype=np.int64)
    births = np.lexsort((-sizes, first))
    deaths = np.argsort(last, kind="stable")
    free = _FreeList()
    d = 0
    for i in births:
        while d < n and last[deaths[d]] < first[i]:
            j = deaths[d]
            free.free(int(offsets[j]), int(sizes[j]))
            d += 1
        offsets[i] = free.alloc(int(sizes[i]))
    return offsets
