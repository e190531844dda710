"""One step of a deep model, composed from the traces of two shallow twins of it.

A transformer's step repeats its middle block: the forward runs it N times, the backward N
times in reverse, the optimizer step and ``zero_grad`` walk its parameters once per block. So
``compose`` takes the traces of two twins of the model (``trace._block_twin``): A with the
blocks ``[0, 1, 2, 3, N-1]`` and B with ``[0, 1, 2, N-1]``, each read as a stream of atoms
(``trace._step_log``), and makes the N-block step's ledger, ops, module windows and records
from A, its middle block (index 2) repeated N - 4 times. Everything downstream (peak,
breakdown, timeline, module records, the caching-allocator replay, lifetimes) is then computed
from the composed tracker by the code that computes it from a traced one (docs/block-reuse.md).

Note 1 (copies). Each run of A's atoms that goes with block 2 (its context in a pass, or in the
global part a run labelled 2: its gradients freed, a foreach op's outputs for its parameters, a
single-tensor optimizer's ops on them) is emitted once per middle block. The copies run up the
blocks unless the atoms around the run say the walk goes down (backward, a list freed from its
end).

Note 2 (references). A storage is named by (block, entry or born, its rank among its block's
storages). Block 2's storages are renamed per copy; a block refers to its neighbours' storages
by offset (the previous block's output, the next one's gradient), so a copy's references land
on the copies beside it, and blocks 1 and 3 must be like block 2 (checked: alike storages,
alike module totals). A reference two or more blocks away counts as one to the first or last
block (a position bias block 0 computes for every later block), or the twin is refused; the
one exception, a host storage freed far from its block (activation offload's host pool, freed
all at once), is read as going with its own block before this (docs/block-reuse.md).

Note 3 (what B checks and gives). Composing A for four blocks must give B's trace exactly,
atom by atom, up to the figures that belong to no block (a foreach op's cost, a global
storage's size, a module's totals): those are affine in the number of blocks, and A - B is
their slope. Any other difference, or a block-1/2/3 mismatch, is a ``NotComposable`` with the
reason, and the caller traces the model whole.

Note 4 (a first step to make). A twin traced for a GPU target counts one step, and
``trace.first_step`` makes the step before it for the allocator's replay on the composed
tracker. What it reads goes with the entries: the mark where the first step makes a storage
(``first.made``) is kept, and a gradient alive at the start is paired again with the gradient
its block's copy makes in the step (``first.grads``); its marks are atoms of the global part.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memfit.measure import Tracker
from memfit.measure._counting import op_name
from memfit.measure._labels import GLOBAL
from memfit.trace._block_twin import MID, TWIN_A, TWIN_B
from memfit.trace._composed_modules import module_records, op_totals
from memfit.trace._step_log import NotComposable, StepLog

__all__ = ["TWIN_A", "TWIN_B", "MIN_BLOCKS", "NotComposable", "StepLog", "Composed", "compose"]

MIN_BLOCKS = 16             # below this, the twins cost about as much as the model


@dataclass
class _Out:
    """A composed stream: atoms as tuples of plain values, each with its source."""

    items: list[tuple] = field(default_factory=list)
    source: list[int | None] = field(default_factory=list)   # A's atom index, None if copied


def _check_middles(log: StepLog) -> None:
    """Note 2: blocks 1, 2 and 3 of twin A hold and make alike storages, and their modules
    total alike."""
    led = log.tracker.ledger
    seen = {lab: [] for lab in (1, 2, 3)}
    for sid, (lab, kind, _) in log.key.items():
        if lab in seen:
            seen[lab].append((kind, led._nbytes[sid], led._category[sid],
                              sid in led._host, sid in led._unified))
    if not seen[1] == seen[2] == seen[3]:
        raise NotComposable("the middle blocks' storages differ between blocks 1, 2 and 3")
    totals = {lab: [] for lab in (1, 2, 3)}    # a module record a block's copies reuse
    for name, rec in log.tracker.watch.records.items():
        lab = log.slot_of_module(name)
        if lab in totals:
            totals[lab].append((name[len(log.prefix) + 1:].partition(".")[2],
                                rec.calls, rec.input_bytes, rec.saved_bytes,
                                rec.call_saved_bytes))
    if not totals[1] == totals[2] == totals[3]:
        raise NotComposable("a block module's totals differ between blocks 1, 2 and 3 "
                            "(a module still running while later blocks run)")


def _slot_map(log: StepLog, n: int):
    d = log.depth

    def cs(slot: int, copy: int | None) -> int:
        if slot == MID and copy is not None:
            return MID + copy
        return {0: 0, 1: 1, d - 2: n - 2, d - 1: n - 1}[slot]

    def ref(lab: int, ctx: int, copy: int | None) -> int:
        """Note 2: the composed block of a storage labelled ``lab`` seen from ``ctx``."""
        if lab == GLOBAL:
            return GLOBAL
        if ctx == GLOBAL:
            if lab == MID:
                return MID + copy
            return cs(lab, None)
        off = lab - ctx
        if abs(off) <= 1:
            if ctx == MID:
                return MID + copy + off
            if lab == MID:          # block 1 or 3 looking at the middle: the copy beside it
                return MID if ctx < MID else n - 3
            return cs(lab, None)
        if lab in (0, d - 1):
            return cs(lab, None)
        raise NotComposable(f"block {ctx} refers to a storage of block {lab}, two or more away")
    return cs, ref


def _renamed(log: StepLog, name: str, block: int) -> str:
    """``name`` (a module's or a parameter's) in composed block ``block`` where it is in a
    block, as the marks of a copy are named."""
    if log.slot_of_module(name) == GLOBAL:
        return name
    rest = name[len(log.prefix) + 1:].partition(".")[2]
    return f"{log.prefix}.{block}" + (f".{rest}" if rest else "")


def _mid_runs(labels: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of ``labels`` that go with block 2: the atoms (or the
    entries) copied per middle block (Note 1)."""
    runs, i, n = [], 0, len(labels)
    while i < n:
        if labels[i] == MID:
            j = i
            while j < n and labels[j] == MID:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def _direction(log: StepLog, start: int, end: int) -> int:
    """+1 when the copies run up the blocks, -1 down (Note 1)."""
    def nearest(rng):
        for x in rng:
            if log.effective[x] not in (GLOBAL, MID):
                return log.effective[x]
        return None
    before = nearest(range(start - 1, -1, -1))
    if before is not None:
        return 1 if before < MID else -1
    after = nearest(range(end, len(log.atoms)))
    return 1 if after is None or after > MID else -1


def _stream(log: StepLog, n: int) -> _Out:
    """The composed stream for ``n`` blocks: entries, then the atoms (Notes 1 and 2)."""
    copies = n - log.depth + 1
    cs, ref = _slot_map(log, n)
    led = log.tracker.ledger
    out = _Out()

    def storage(sid: int, ctx: int, copy: int | None) -> tuple:
        lab, kind, rank = log.key[sid]
        return (ref(lab, ctx, copy), kind, rank)

    def emit(i: int, ctx: int, copy: int | None) -> None:
        a = log.atoms[i]
        if a[0] == "ev":
            sid = led._ev_sid[a[1]]
            out.items.append(("ev", storage(sid, ctx, copy), a[1]))
        elif a[0] == "op":
            out.items.append(("op", a[1]))
        else:
            kind, name, phase, _, _ = a[1]
            slot = log.slot_of_module(name)
            if slot != GLOBAL:        # a block's backward ends after the next one's starts
                name = _renamed(log, name, ref(slot, ctx, copy))
            out.items.append(("mk", kind, name, phase))
        out.source.append(i if copy is None else None)

    # entries: a run of block 2's is copied (its parameters, their state)
    entries = list(led._entry)
    entry_runs = dict(_mid_runs([log.label[sid] for sid in entries]))
    i = 0
    while i < len(entries):
        if i in entry_runs:
            end = entry_runs[i]
            for c in range(copies):
                for sid in entries[i:end]:
                    out.items.append(("entry", storage(sid, GLOBAL, c), sid))
                    out.source.append(None)
            i = end
            continue
        out.items.append(("entry", storage(entries[i], GLOBAL, None), entries[i]))
        out.source.append(-1 - i)            # entries' sources are negative
        i += 1
    runs = dict(_mid_runs(log.effective))
    i = 0
    while i < len(log.atoms):
        if i in runs:
            end = runs[i]
            order = range(copies) if _direction(log, i, end) > 0 else \
                range(copies - 1, -1, -1)
            for c in order:
                for x in range(i, end):
                    emit(x, MID, c)
            i = end
            continue
        emit(i, log.effective[i], None)
        i += 1
    return out


def _canonical(out: _Out, log: StepLog) -> list[tuple]:
    """The stream with storages numbered by first appearance and the figures that may change
    with depth left out (Note 3)."""
    led, t = log.tracker.ledger, log.tracker
    names: dict[tuple, int] = {}
    res = []
    for it in out.items:
        if it[0] in ("entry", "ev"):
            key = it[1]
            num = names.setdefault(key, len(names))
            sid = it[2] if it[0] == "entry" else led._ev_sid[it[2]]
            size = None if key[0] == GLOBAL else \
                (led._entry[sid] if it[0] == "entry" else led._ev_delta[it[2]])
            resize = it[0] == "ev" and it[2] in led._resizes
            res.append((it[0], num, size, resize, led._category[sid], sid in led._host,
                        sid in led._unified))
        elif it[0] == "op":
            res.append(("op", op_name(t.op_log[it[1]])))
        else:
            res.append(it)
    return res


def _b_stream(log: StepLog) -> _Out:
    """Twin B's own stream, its blocks named as composing for its depth names them."""
    out = _Out()
    led = log.tracker.ledger
    for sid in led._entry:
        out.items.append(("entry", log.key[sid], sid))
        out.source.append(None)
    for a in log.atoms:
        if a[0] == "ev":
            out.items.append(("ev", log.key[led._ev_sid[a[1]]], a[1]))
        elif a[0] == "op":
            out.items.append(("op", a[1]))
        else:
            out.items.append(("mk",) + a[1][:3])
        out.source.append(None)
    return out


@dataclass
class _Slopes:
    """Per A atom (entries negative) and per global module: A's figure minus B's (Note 3)."""

    entry: dict[int, int] = field(default_factory=dict)       # A entry sid -> bytes slope
    event: dict[int, int] = field(default_factory=dict)       # A event index -> delta slope
    op: dict[int, tuple] = field(default_factory=dict)        # A op index -> cost slopes


def _slopes(a: StepLog, b: StepLog) -> _Slopes:
    """Compose A for B's depth, check it is B (Note 3), and return the slopes."""
    short, own = _stream(a, b.depth), _b_stream(b)
    mine, theirs = _canonical(short, a), _canonical(own, b)
    if len(mine) != len(theirs):
        raise NotComposable(f"twin A composed for {b.depth} blocks has {len(mine)} atoms, "
                            f"twin B {len(theirs)}")
    for x, (p, q) in enumerate(zip(mine, theirs)):
        if p != q:
            raise NotComposable(f"twin A composed for {b.depth} blocks differs from twin B at "
                                f"atom {x}: {p} != {q}")
    s = _Slopes()
    la, lb = a.tracker.ledger, b.tracker.ledger
    for it, src, bit in zip(short.items, short.source, own.items):
        if it[0] == "entry" and src is not None:
            s.entry[it[2]] = la._entry[it[2]] - lb._entry[bit[2]]
        elif it[0] == "ev" and src is not None:
            s.event[it[2]] = la._ev_delta[it[2]] - lb._ev_delta[bit[2]]
        elif it[0] == "op" and src is not None:
            s.op[it[1]] = tuple(x - y for x, y in zip(a.tracker.op_costs[it[1]],
                                                      b.tracker.op_costs[bit[1]]))
    return s


@dataclass
class Composed:
    """The ``n``-block step's tracker, and where each of twin A's ops (those not copied) went."""

    tracker: Tracker
    op_index: dict[int, int]


def compose(a: StepLog, b: StepLog, n: int) -> Composed:
    """The tracker of the ``n``-block step, from twins A and B (module docstring)."""
    if n < a.depth:
        raise NotComposable(f"{n} blocks are fewer than the twins need")
    _check_middles(a)
    slopes = _slopes(a, b)
    extra = n - a.depth
    out = _stream(a, n)
    ta, la = a.tracker, a.tracker.ledger
    t = Tracker(device=ta.device_type, fake=ta.fake)
    led = t.ledger
    sids: dict[tuple, int] = {}
    grads: list[tuple[int, int, int]] = []   # composed entry gradient, its block, A's sid
    op_of: dict[int, int] = {}           # A op index (not copied) -> composed op index
    starts: dict[tuple[str, str], list[tuple[int, int]]] = {}
    op_windows: list[tuple[str, str, int, int]] = []       # name, phase, first op, end op

    def new_sid(key: tuple, a_sid: int, nbytes: int) -> int:
        if key in sids:
            raise NotComposable(f"storage {key} is born twice in the composed step")
        sid = sids[key] = led.add_unseen(nbytes, la._category[a_sid], host=a_sid in la._host,
                                         unified=a_sid in la._unified)
        return sid

    for it, src in zip(out.items, out.source):
        kind = it[0]
        if kind == "entry":
            a_sid = it[2]
            slope = extra * slopes.entry.get(a_sid, 0) if src is not None else 0
            sid = new_sid(it[1], a_sid, la._nbytes[a_sid] + slope)
            led._entry[sid] = la._entry[a_sid] + slope
            if a_sid in la.first.made:                  # Note 4
                led.first.made[sid] = _renamed(a, la.first.made[a_sid], it[1][0])
            if a_sid in la.first.grads:
                grads.append((sid, it[1][0], a_sid))
            for older in ("older", "late"):
                if a_sid in getattr(la.first, older):
                    getattr(led.first, older).add(sid)
        elif kind == "ev":
            i = it[2]
            a_sid = la._ev_sid[i]
            slope = extra * slopes.event.get(i, 0) if src is not None else 0
            delta = la._ev_delta[i] + slope
            sid = sids.get(it[1])
            if i in la._resizes or delta < 0:
                if sid is None:
                    raise NotComposable(f"storage {it[1]} changes before it is born")
            else:
                sid = new_sid(it[1], a_sid, la._nbytes[a_sid] + slope)
            if i in la._resizes:
                led._resizes.add(led.num_events)
            led._log(sid, delta)
        elif kind == "op":
            j = it[1]
            if src is not None:
                op_of[j] = len(t.op_events)
            cost = ta.op_costs[j]
            if src is not None and j in slopes.op:
                cost = tuple(x + extra * d for x, d in zip(cost, slopes.op[j]))
            t.op_events.append(led.num_events)
            t.op_log.append(ta.op_log[j])
            t.op_costs.append(cost)
            t.op_backward.append(ta.op_backward[j])
        else:
            _, mk, name, phase = it
            t.marks.append((mk, name, phase, led.num_events, len(t.op_events)))
            if mk == "window":
                t._window_event, t._window_op = led.num_events, len(t.op_events)
            elif mk == "enter":
                starts.setdefault((name, phase), []).append((led.num_events, len(t.op_events)))
            elif mk == "exit" and starts.get((name, phase)):
                ev, op = starts[(name, phase)].pop()
                t._windows.append((name, phase, ev, led.num_events - 1))
                op_windows.append((name, phase, op, len(t.op_events)))
    ref = _slot_map(a, n)[1]
    for sid, lab, a_sid in grads:        # Note 4: the gradient made for the same parameter
        plab, kind, rank = a.key[la.first.grads[a_sid]]
        copy = lab - MID if a.key[a_sid][0] == MID else None
        if plab == MID and copy is None:
            continue                     # unpaired: the first step is traced (NotMade)
        partner = sids.get((ref(plab, GLOBAL, copy), kind, rank))
        if partner is not None:
            led.first.grads[sid] = partner
    for (name, phase), s in starts.items():          # still open at the end
        t._windows += [(name, phase, ev, led.num_events - 1) for ev, _ in s]
        op_windows += [(name, phase, op, len(t.op_events)) for _, op in s]
    led.close()
    t.ops = ta.ops + extra * (ta.ops - b.tracker.ops)
    t.fw_flops = ta.fw_flops + extra * (ta.fw_flops - b.tracker.fw_flops)
    t.bw_flops = ta.bw_flops + extra * (ta.bw_flops - b.tracker.bw_flops)
    t.watch.records = module_records(a, b, n, t.marks, _slot_map(a, n)[0])
    op_totals(t, op_windows)
    t._finish_modules()
    t.online_peak_bytes = t.peak_bytes
    return Composed(t, op_of)
