"""Every device storage of a traced (or tracked) step: its size, birth and death.

Note 1 (versions). A storage resized in place (``resize_``, ``set_``: FSDP2's unsharded
weights) is, for the allocator, a free of the old block and a malloc of the new one
(``trace.cuda.CudaModel.replay``). So each size a storage takes is one *version* here, born at
the resize event that gave it that size and dead at the next one.

Note 2 (op points). The ledger's events are births and deaths; ``Tracker.op_events[i]`` is
the number of events after op ``i``, and the timeline's point ``i`` is the live bytes after
event ``op_events[i] - 1`` (its births and every death before). An event ``e`` is thus first
seen at op point ``bisect_right(op_events, e)``. A version is live at the window's op points
``first_op..last_op`` (window-relative; ``-1`` is the window's start, before its first op).
Storages alive at the start are the previous step's (gradients) or the run's (parameters,
optimizer state).

Note 3 (what is kept). ``StorageLog`` is a few numpy arrays copied from the ledger when the
trace ends: no tensor, storage or weak reference, so an ``Estimate`` keeping it keeps nothing
alive (DESIGN "what the checks have taught").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["StorageLog", "Lifetimes", "storage_log", "step_lifetimes"]


@dataclass(frozen=True, eq=False)
class StorageLog:
    """The device storages of a traced region, one row per version (Note 1)."""

    nbytes: np.ndarray        # int64 per version: storage bytes
    category: np.ndarray      # int64 per version: index into CATEGORIES
    birth_event: np.ndarray   # int64 per version: ledger event, -1 = alive at the region's start
    death_event: np.ndarray   # int64 per version: ledger event, num_events = outlived the region
    op_events: np.ndarray     # int64 per op: ledger events after it (Note 2)
    num_events: int           # ledger events in the region
    window_event: int         # first event of the counted step
    window_op: int            # first op of the counted step

    @property
    def num_ops(self) -> int:
        """Ops of the counted step (the timeline's length)."""
        return len(self.op_events) - self.window_op

    def window(self) -> "Lifetimes":
        """The versions live during the counted step, as op-point intervals (Note 2)."""
        w = self.window_event
        alive = (self.death_event >= w) & (self.nbytes > 0)
        first = np.searchsorted(self.op_events, self.birth_event, side="right") - self.window_op
        first = np.where(self.birth_event < w, -1, first)
        last = np.searchsorted(self.op_events, self.death_event, side="right") - 1 - self.window_op
        last = np.minimum(last, self.num_ops - 1)
        keep = alive & (first <= last)
        idx = np.flatnonzero(keep)
        return Lifetimes(self.nbytes[idx].copy(), self.category[idx].copy(), first[idx],
                         last[idx], self.num_ops, idx)


@dataclass(frozen=True, eq=False)
class Lifetimes:
    """Versions as intervals of op points ``first_op..last_op`` (inclusive, -1 = start)."""

    nbytes: np.ndarray
    category: np.ndarray
    first_op: np.ndarray
    last_op: np.ndarray
    num_ops: int
    version: np.ndarray       # row in the StorageLog

    def __len__(self) -> int:
        return len(self.nbytes)

    def live_bytes(self, sizes: np.ndarray | None = None) -> np.ndarray:
        """Live bytes at each op point -1..num_ops-1 (index 0 is the start), with ``sizes``
        (default: ``nbytes``)."""
        sizes = self.nbytes if sizes is None else sizes
        diff = np.zeros(self.num_ops + 2, dtype=np.int64)
        np.add.at(diff, self.first_op + 1, sizes)
        np.add.at(diff, self.last_op + 2, -sizes)
        return np.cumsum(diff)[:-1]


def storage_log(tracker) -> StorageLog:
    """The ``StorageLog`` of a finished ``Tracker`` (``trace.profile_step``'s or ``track``'s):
    device storages only, host ones (offload) left out."""
    ledger = tracker.ledger
    shift = ledger.first.length       # a first step made, not traced: its events come first
    end = ledger.num_events + shift
    nbytes, cat, birth, death = [], [], [], []
    current: dict[int, int] = {}               # storage id -> its live version
    categories = ledger.categories()             # final category per storage id (known late)

    def born(sid: int, size: int, ev: int) -> None:
        current[sid] = len(nbytes)
        nbytes.append(size)
        cat.append(categories[sid])
        birth.append(ev)
        death.append(end)

    for ev, sid, delta, is_resize in ledger.device_events():
        if is_resize:
            v = current.pop(sid, None)
            size = delta
            if v is not None:
                death[v] = ev
                size += nbytes[v]
            born(sid, size, ev)
        elif delta > 0:
            born(sid, delta, ev)
        elif sid in current:
            death[current.pop(sid)] = ev
    window_op = len(tracker.op_log) - len(tracker.window_op_log)
    as_array = lambda xs: np.asarray(xs, dtype=np.int64)  # noqa: E731
    op_events = as_array(tracker.op_events) + shift
    if shift:                         # the made first step's ops, then the counted step's
        window_op += len(ledger.first.op_events)
        op_events = np.concatenate([as_array(ledger.first.op_events), op_events])
    return StorageLog(as_array(nbytes), as_array(cat), as_array(birth), as_array(death),
                      op_events, end, tracker.resolved.window_start + shift, window_op)


def step_lifetimes(estimate) -> tuple[StorageLog, Lifetimes]:
    """The estimate's storage log and its counted step's lifetimes; a clear error without.
    A finished ``memfit.track`` region (a ``Tracker``) is read from its own ledger."""
    log = storage_log(estimate) if hasattr(estimate, "ledger") else \
        getattr(estimate, "lifetimes", None)
    if not isinstance(log, StorageLog):
        raise ValueError("this estimate carries no storage lifetimes (estimates of one rank of "
                         "a sharded job, and those made before memplan existed, do not): run "
                         "memfit.estimate(model, batch, ...) without gpus/sharding")
    return log, log.window()
