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
outlives it or one older that dies there, a resize, a move to the host, a symbolic size, a
gradient sum merged in place, or a tracker that labels storages by block (``trace.block_reuse``
reads the labels per storage). Who may call it with which calls: ``trace.per_parameter``.
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


@dataclass(frozen=True)
class _Mark:
    events: int
    ops: int
    storages: int
    entries: int
    merged: int


def opening(tracker) -> _Mark:
    """Where a stretch that may be recorded starts."""
    led = tracker.ledger
    return _Mark(led.num_events, len(tracker.op_events), len(led._nbytes), len(led._entry),
                 len(led._alias))


def recorded(tracker, mark: _Mark) -> Stretch | None:
    """The stretch from ``mark`` to now, or None where it is not closed (Note 1)."""
    led = tracker.ledger
    if not led.fake or tracker.labels is not None or len(led._entry) != mark.entries or \
            len(led._alias) != mark.merged or len(tracker.op_events) == mark.ops:
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
    storages = tuple((led._nbytes[s], led._category[s], s in led._host, s in led._unified)
                     for s in range(first, last))
    ops = tuple((tracker.op_events[j] - mark.events, tracker.op_log[j], tracker.op_costs[j],
                 tracker.op_backward[j]) for j in range(mark.ops, len(tracker.op_events)))
    return Stretch(storages, tuple((s - first, d) for s, d in zip(sids, deltas)), ops)


def repeat(tracker, stretch: Stretch) -> None:
    """Append a copy of ``stretch`` to ``tracker``: what running its ops again would count
    (Note 1)."""
    led = tracker.ledger
    base = len(led._nbytes)
    for nbytes, category, host, unified in stretch.storages:
        sid = len(led._nbytes)
        led._nbytes.append(nbytes)
        led._category.append(category)
        led._ptr.append(0)
        led._refs.append(None)
        if host:
            led._host.add(sid)
        if unified:
            led._unified.add(sid)
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


def _emit(led, stretch: Stretch, base: int, start: int, end: int) -> int:
    """Log events ``start:end`` of ``stretch`` on storages numbered from ``base``."""
    for index, delta in stretch.events[start:end]:
        sid = base + index
        led._log(sid, delta)
        if sid not in led._host:
            led.current_bytes += delta
    return end
