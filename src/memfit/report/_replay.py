"""Replay a traced step's storages block by block: the verdict's curve per op, and the
allocator's events and segments a memory snapshot is made of (``report.snapshot``).

Note 1 (the curve is the verdict's quantity). On a CPU target the allocated bytes are the live
tensor bytes, ``est.timeline``. On a GPU target the verdict's allocated peak comes from the
caching-allocator replay (``CudaModel.replay_peaks``: 512-byte rounding, unsplit blocks, the cuBLAS
workspaces), which the live-bytes timeline does not show. The same replay is run here, op by op,
with the same ledger events in the same order as ``CudaModel.replay``, so the curve's maximum is
``est.peak_bytes`` and the reserved curve's maximum ``est.reserved_bytes`` (tests hold them to it).

Note 2 (addresses). A snapshot names blocks by address. On a GPU target they are the replay's
blocks (one read of each new block's address and size, ``CachingAllocator``'s C++-named
internals); a new segment is what the reservation grew by, starting at the new block (a fresh
cudaMalloc'd segment is split from its start). Expandable segments map pages inside one range
and are not written as segments (refused by the snapshot; the curve is still exact). On a CPU
target there is no cache: each storage is its own segment, sizes exact.

Note 3 (the window). Events before the counted step (step 1 of a two-step trace, storages alive
on entry) shape the state the step starts from; the snapshot's trace holds the counted step's
events only, as ``torch.cuda.memory._record_memory_history`` started at its first op would.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.measure import CATEGORIES
from memfit.trace.allocator import AllocatorConfig, CachingAllocator

__all__ = ["Replayed", "replay", "WORKSPACE"]

WORKSPACE = "cuBLAS workspace"
_OTHER = CATEGORIES.index("other")
_WORKSPACE_FRAMES = [{"filename": "cuBLAS", "line": 0, "name": WORKSPACE}]


@dataclass
class Replayed:
    """Bytes after each op of the counted step, and the allocator's record."""

    allocated: list[int]                 # allocated bytes after each op (Note 1)
    reserved: list[int]                  # reserved bytes after each op (== allocated on CPU)
    by_category: dict[str, list[int]]    # allocated bytes per category after each op
    peak_bytes: int                      # allocated peak over the step's events
    reserved_peak_bytes: int
    trace: list[dict] = field(default_factory=list)      # snapshot events (Note 3)
    segments: list[dict] = field(default_factory=list)   # segment state where the replay ended


class _Exact:
    """No cache (a CPU target): each storage its own segment (Note 2)."""

    def __init__(self):
        self.allocated = self.reserved = 0
        self._next = 1 << 32
        self._size: dict[int, int] = {}

    def malloc(self, nbytes: int):
        addr = self._next
        self._next += -(-nbytes // 512) * 512 + 512
        self._size[addr] = nbytes
        self.allocated += nbytes
        self.reserved += nbytes
        return addr, addr, nbytes, (addr, nbytes)          # handle, address, block, segment

    def free(self, handle: int):
        n = self._size.pop(handle)
        self.allocated -= n
        self.reserved -= n
        return (handle, n)                                  # the segment released


class _Cuda:
    """The caching allocator model (Note 2)."""

    def __init__(self, config: AllocatorConfig):
        self.a = CachingAllocator(config)
        self.expandable = config.expandable_segments

    @property
    def allocated(self) -> int:
        return self.a.allocated_bytes

    @property
    def reserved(self) -> int:
        return self.a.reserved_bytes

    def malloc(self, nbytes: int):
        before = self.reserved
        h = self.a.malloc(nbytes)
        addr, size = self.a.block_of(h) or (0, 0)
        grew = self.reserved - before
        if grew < 0 and not self.expandable:
            raise ValueError("the allocator model released cached segments to serve a request "
                             "(a capacity was set): such a replay is not written as a snapshot; "
                             "estimate without AllocatorConfig(capacity_bytes=...)")
        segment = (addr, grew) if grew and not self.expandable else None
        return h, addr, size, segment

    def free(self, handle: int):
        self.a.free(handle)
        return None


def replay(est, tracker, *, allocator: AllocatorConfig | None = None,
           frames: Callable[[int, int], list] | None = None,
           stop_after_op: int | None = None) -> Replayed:
    """Replay ``tracker``'s ledger (the trace behind ``est``, ``report._capture``) op by op.

    ``frames(op, category)`` -> the frames of a snapshot event at that op (None: no snapshot
    events); ``stop_after_op``: end after that op of the step (a snapshot taken there).
    """
    cuda = est.basis == "cuda-model"
    mem = _Cuda(allocator or AllocatorConfig()) if cuda else _Exact()
    ledger = tracker.ledger
    shift = ledger.first.length      # a first step made, not traced: its events come first
    window = tracker.resolved.window_start + shift
    n = len(est.timeline)
    ops = [e + shift for e in tracker.op_events[len(tracker.op_events) - n:]]
    last = n - 1 if stop_after_op is None else stop_after_op
    cats = ledger.categories()                     # storage id -> final category (known late)
    live: dict = {}                              # key -> (handle, addr, block bytes, req, cat, fr)
    segments: dict[int, int] = {}                # address -> bytes
    by_cat = [0] * len(CATEGORIES)
    out = Replayed([], [], {c: [] for c in CATEGORIES}, -1, 0)
    recording = [False]

    def emit(action, addr, size, fr):
        if recording[0] and frames is not None:
            out.trace.append({"action": action, "addr": addr, "size": size, "stream": 0,
                              "time_us": len(out.trace), "frames": fr})

    def alloc(key, nbytes, cat, op):
        h, addr, size, seg = mem.malloc(nbytes)
        fr = [] if frames is None else _WORKSPACE_FRAMES if isinstance(key, tuple) else \
            frames(op, cat)
        if seg is not None:
            segments[seg[0]] = seg[1]
            emit("segment_alloc", seg[0], seg[1], fr)
        emit("alloc", addr, nbytes, fr)
        live[key] = (h, addr, size, nbytes, cat, fr)
        by_cat[cat] += size

    def free(key, op):
        h, addr, size, nbytes, cat, fr = live.pop(key)
        emit("free_requested", addr, nbytes, fr)
        emit("free_completed", addr, nbytes, fr)
        released = mem.free(h)
        by_cat[cat] -= size
        if released is not None:
            del segments[released[0]]
            emit("segment_free", released[0], released[1], fr)

    def flush(upto):                              # ops before ``upto`` are complete
        while len(out.allocated) < min(upto, last + 1):
            out.allocated.append(mem.allocated)
            out.reserved.append(mem.reserved)
            for c, v in zip(CATEGORIES, by_cat):
                out.by_category[c].append(v)

    workspaces_done = not cuda
    for ev, sid, delta, is_resize in ledger.device_events():
        if not workspaces_done and ev >= 0:      # the cuBLAS workspaces: the first matmuls'
            for i, size in enumerate((est.device.cublas_workspace_bytes,
                                      est.device.autograd_workspace_bytes)):
                alloc((WORKSPACE, i), size, _OTHER, -1)
            workspaces_done = True
        point = bisect.bisect_right(ops, ev) if ev >= window else -1   # the op it shows in
        op = min(point, n - 1)
        if ev >= window:
            if op > last or point > last and stop_after_op is not None:
                break
            recording[0] = True
            flush(point)                         # after the last op: the series is complete
        if is_resize:
            old = live[sid][3]
            free(sid, op)
            alloc(sid, old + delta, cats[sid], op)
        elif delta > 0:
            alloc(sid, delta, cats[sid], op)
        elif sid in live:
            free(sid, op)
        if ev >= window:
            out.peak_bytes = max(out.peak_bytes, mem.allocated)
            out.reserved_peak_bytes = max(out.reserved_peak_bytes, mem.reserved)
    if not workspaces_done:
        for i, size in enumerate((est.device.cublas_workspace_bytes,
                                  est.device.autograd_workspace_bytes)):
            alloc((WORKSPACE, i), size, _OTHER, -1)
    flush(n)
    if out.peak_bytes < 0:
        out.peak_bytes, out.reserved_peak_bytes = mem.allocated, mem.reserved
    out.segments = _segments(segments, live.values()) if frames is not None else []
    return out


def _segments(segments: dict[int, int], blocks) -> list[dict]:
    """The segments as ``torch.cuda.memory._snapshot()`` lists them: every byte of each in one
    block, allocated or not, in address order."""
    by_addr = sorted((b[1], b[2], b[3], b[5]) for b in blocks if b[2])
    out = []
    for start, size in sorted(segments.items()):
        i = bisect.bisect_left(by_addr, (start,))
        addr, blocks_out, active, requested = start, [], 0, 0
        while i < len(by_addr) and by_addr[i][0] < start + size:
            b_addr, b_size, req, fr = by_addr[i]
            if b_addr > addr:
                blocks_out.append(_inactive(addr, b_addr - addr))
            blocks_out.append({"address": b_addr, "size": b_size, "requested_size": req,
                               "state": "active_allocated", "frames": fr})
            active, requested = active + b_size, requested + req
            addr, i = b_addr + b_size, i + 1
        if addr < start + size:
            blocks_out.append(_inactive(addr, start + size - addr))
        out.append({"device": 0, "address": start, "total_size": size, "allocated_size": active,
                    "active_size": active, "requested_size": requested, "stream": 0,
                    "segment_type": "small" if size <= 2 << 20 else "large",
                    "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                    "blocks": blocks_out})
    return out


def _inactive(addr: int, size: int) -> dict:
    return {"address": addr, "size": size, "requested_size": 0, "state": "inactive",
            "frames": []}
