"""A stretch of a fake trace that a later, identical call repeats: counted once, then copied.

Note 1 (what may be copied). A call whose every storage is born and dies inside it (an
optimizer's update of one parameter at the steady state: its temporaries, nothing kept, the
parameter and its state written in place) leaves the ledger a closed run of events and the
counter one mark per op. Another call that does the same ops on tensors of the same metadata
makes the same run: the same sizes born and freed in the same order, the same op costs. So
``repeat`` appends a copy of the recorded run (fresh storage ids, the same sizes, categories
and placement, each op's mark, aten op, cost and FLOPs) instead of running the ops, and every
figure read from the ledger afterwards (timeline, peak, breakdown, the allocator's replay) is
the one the ops would have given. ``recorded`` refuses a run that is not closed: a storage
first read there (an entry, which a copy could not register again), one born there that
outlives it or one older that dies there, a resize, a move to the host, a symbolic size, or a
gradient sum merged in place. Who may call it with which calls: ``trace.per_parameter``.

Note 2 (block labels). A tracker that labels storages and ops by block (``measure._labels``,
for ``trace.block_reuse``) keeps, per op, the storages it read and made, and labels them once
the region is over: a per-parameter update's temporaries take the block of the parameter it
read. A copy's ops read the other call's parameter, gradient and state, so the caller gives
the storages each call reads (``reads``, the same structure in both): a recorded op's input
that is one of the recorded call's reads becomes the same read of the copy's call, one born in
the stretch becomes its copy, and any other (a storage every call shares) stays.

Note 3 (another tracker). A stretch holds sizes, categories, events relative to its own
storages, ops and costs: nothing of the tracker it was recorded in but its labels' storage
ids. So it may be copied into another tracker of a trace made alike (the two twins of one
step, ``trace.per_parameter``) where its labels name only the call's reads and its own
births; one that names a storage every call shares (an id of the other tracker) is refused
there.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Stretch", "opening", "recorded", "repeat"]


@dataclass(frozen=True)
class Stretch:
    """A closed run of a fake tracker's events and ops (Note 1)."""

    storages: tuple[tuple[int, int, bool, bool], ...]   # (bytes, category, host, unified)
    events: tuple[tuple[int, int], ...]                  # (storage index, +/- bytes)
    # per op: (events before its mark, the aten op, its cost tuple, whether in backward)
    ops: tuple[tuple[int, object, tuple, bool], ...]
    first: int = 0                  # the recorded storages' first id (Note 2)
    reads: tuple[int, ...] = ()     # the storage ids the recorded call read (Note 2)
    labelled: tuple = ()            # its ops' entries in the tracker's labels (Note 2)
    ledger: int = 0                 # id of the ledger it was recorded in (Note 3)
    portable: bool = True           # its labels name only its reads and births (Note 3)


@dataclass(frozen=True)
class _Mark:
    events: int
    ops: int
    storages: int
    entries: int
    merged: int
    labelled: int


def opening(tracker) -> _Mark:
    """Where a stretch that may be recorded starts."""
    led = tracker.ledger
    labels = tracker.labels
    return _Mark(led.num_events, len(tracker.op_events), len(led._nbytes), len(led._entry),
                 len(led._alias), len(labels.ops) if labels is not None else 0)


def recorded(tracker, mark: _Mark, reads: tuple[int, ...] = ()) -> Stretch | None:
    """The stretch from ``mark`` to now, or None where it is not closed (Note 1); ``reads``:
    the storage ids the call read (Note 2)."""
    led = tracker.ledger
    if not led.fake or len(led._entry) != mark.entries or len(led._alias) != mark.merged or \
            len(tracker.op_events) == mark.ops:
        return None
    first, last = mark.storages, len(led._nbytes)
    sids, deltas = led._ev_sid[mark.events:], led._ev_delta[mark.events:]
    net = [0] * (last - first)
    for i, (sid, delta) in enumerate(zip(sids, deltas), start=mark.events):
        if sid < first or i in led._resizes or i in led._ev_expr:
            return None
        net[sid - first] += delta
    if any(net) or any(sid in led._size_expr or sid in led._moved
                       for sid in range(first, last)):
        return None
    labelled = ()
    if tracker.labels is not None:
        labelled = tuple(tracker.labels.ops[mark.labelled:])
        if len(labelled) != len(tracker.op_events) - mark.ops:
            return None
    storages = tuple((led._nbytes[s], led._category[s], s in led._host, s in led._unified)
                     for s in range(first, last))
    ops = tuple((tracker.op_events[j] - mark.events, tracker.op_log[j], tracker.op_costs[j],
                 tracker.op_backward[j]) for j in range(mark.ops, len(tracker.op_events)))
    return Stretch(storages, tuple((s - first, d) for s, d in zip(sids, deltas)), ops, first,
                   tuple(reads), labelled, id(led), _portable(labelled, first, last, reads))


def repeat(tracker, stretch: Stretch, reads: tuple[int, ...] = ()) -> bool:
    """Append a copy of ``stretch`` to ``tracker``: what running its ops again would count
    (Note 1); ``reads``: the storage ids this call reads, as the recorded call's (Note 2).
    False, and nothing appended, where the labels cannot follow the copy (reads that do not
    match)."""
    if tracker.labels is not None and (len(reads) != len(stretch.reads) or (
            stretch.ledger != id(tracker.ledger) and not stretch.portable)):
        return False
    led = tracker.ledger
    base = len(led._nbytes)
    for nbytes, category, host, unified in stretch.storages:
        led.add_unseen(nbytes, category, host=host, unified=unified)
    if tracker.labels is not None:
        _relabelled(tracker.labels, stretch, base, dict(zip(stretch.reads, reads)))
    done = 0
    for before, func, cost, backward in stretch.ops:
        done = _emit(led, stretch, base, done, before)
        if led.current_bytes > tracker.online_peak_bytes:
            tracker.online_peak_bytes = led.current_bytes
        tracker.ops += 1
        tracker.last_op = func
        tracker.op_events.append(led.num_events)
        tracker.op_log.append(func)
        tracker.op_costs.append(cost)
        tracker.op_backward.append(backward)
        flops, touched = cost[0], cost[1]
        tracker.watch.touched(touched, backward)
        if flops:
            if backward:
                tracker.bw_flops += flops
            else:
                tracker.fw_flops += flops
            tracker.watch.flops(flops, backward)
    _emit(led, stretch, base, done, len(stretch.events))
    return True


def _portable(labelled: tuple, first: int, last: int, reads) -> bool:
    """Labels that name no storage but the call's reads and its births ``first..last-1``
    (Note 3)."""
    own = set(range(first, last)) | set(reads)
    return all(s in own for running, inputs, pairs, made, fetch in labelled
               for s in (*inputs, *made, *(x for src, out in pairs for x in (*src, *out))))


def _relabelled(labels, stretch: Stretch, base: int, read_of: dict[int, int]) -> None:
    """The copy's ops' entries in ``labels``: the recorded ones, their storages mapped (Note 2)."""
    end = stretch.first + len(stretch.storages)

    def sid(s: int) -> int:
        if stretch.first <= s < end:
            return base + s - stretch.first
        return read_of.get(s, s)

    for running, inputs, pairs, made, fetch in stretch.labelled:
        labels.ops.append((running, tuple(sid(s) for s in inputs),
                           tuple((tuple(sid(s) for s in src), tuple(sid(s) for s in out))
                                 for src, out in pairs),
                           tuple(sid(s) for s in made), fetch))


def _emit(led, stretch: Stretch, base: int, start: int, end: int) -> int:
    """Log events ``start:end`` of ``stretch`` on storages numbered from ``base``."""
    for index, delta in stretch.events[start:end]:
        sid = base + index
        led._log(sid, delta)
        if sid not in led._host:
            led.current_bytes += delta
    return end
