"""A finished tracker that labelled its storages by block, read as one stream of atoms.

``StepLog.of(tracker, prefix, depth)`` reads what a tracker given the model's block names kept
(``Tracker(blocks=...)``: its ledger, ops, module entries and exits, ``measure._labels``) as the
stream ``trace.block_reuse`` composes a deeper step from.

Note 1 (atoms and contexts). The atoms are the ledger's events (a storage born, dead or
resized), the ops, and the module entries and exits (``Tracker.marks``), in the order they
happened. An atom runs in a block's context from that block's entry to the next block's entry in
the same pass (a block's backward may end after the next one's starts), else in the global
context (embeddings, loss, ``zero_grad``, the optimizer step). What runs between two blocks
belongs to the first (its post-hooks: activation offload freeing the block's input), unless it
fetches a block's weights ahead (parameter offload: the next block's pre-hook, which runs before
its entry is marked, fetching the block after it); then it belongs to the next one. Each atom
goes with one block, or none: in a block's context, that block (a far death apart: Note 3); in
the global context, a birth's label, an op's (or, with no tensor input, that of what it made),
and a death's or resize's, except one of a neighbour's storage amid the ops on a block's
parameters (a single-tensor optimizer frees the previous parameter's temporary while it steps
the next).

Note 2 (storage names). A storage is named by (its block, entry or born, its rank among its
block's storages of that kind). Its block is the one whose parameter state it copies (a
weight fetched ahead of its block: ``measure._labels``' ``copied``), else its context at
birth, else the tracker's label,
else, for a global birth no op reads, the block of the storage that died just before it in the
same run of deaths (a KV cache's per-layer state, freed layer by layer with its keys and values).

Note 3 (host deaths far from their context). Activation offload's host pool frees every
block's buffers at once, last made first, when the last saved tensor is released, inside block
0's backward (docs/block-reuse.md): a run of deaths of blocks N-1 .. 0, in block 0's context. A
death or resize of a middle block's host storage two or more blocks away from its context goes
with the storage's own block, as it would in the global context, so that run is copied per
middle block in the order it has (down the blocks) instead of refused as a reference two blocks
away. Any other reference that far is still refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memfit.measure import Tracker
from memfit.measure._labels import GLOBAL

__all__ = ["StepLog", "NotComposable"]


class NotComposable(Exception):
    """Twins whose traces do not compose into the model's step: trace it whole."""


@dataclass
class StepLog:
    """A finished labelled tracker, read as atoms (Note 1) with named storages (Note 2)."""

    tracker: Tracker
    prefix: str                # the block list's qualified name
    depth: int
    atoms: list[tuple] = field(default_factory=list)   # ("ev", i) | ("op", j) | ("mk", m)
    context: list[int] = field(default_factory=list)   # per atom
    label: dict[int, int] = field(default_factory=dict)  # storage id -> block or GLOBAL
    key: dict[int, tuple] = field(default_factory=dict)  # storage id -> (label, kind, rank)
    effective: list[int] = field(default_factory=list)  # per atom: the block it is copied with

    @staticmethod
    def of(tracker: Tracker, prefix: str, depth: int) -> "StepLog":
        log = StepLog(tracker, prefix, depth)
        log._atoms()
        log._contexts()
        log._keys()
        log._effective()
        return log

    # -- reading -----------------------------------------------------------------------------
    def slot_of_module(self, name: str) -> int:
        if not name.startswith(self.prefix + "."):
            return GLOBAL
        head = name[len(self.prefix) + 1:].split(".", 1)[0]
        return int(head) if head.isdigit() else GLOBAL

    def _atoms(self) -> None:
        """The events, ops and marks in the order they happened, each ordered by (ops done,
        events done, kind): a mark before an event before an op at one point (an op ends once
        its events are in). The keys are made and sorted by numpy (a stable sort: marks at one
        point keep their order)."""
        t = self.tracker
        n_ev, n_op = t.ledger.num_events, len(t.op_events)
        ends = np.asarray(t.op_events, dtype=np.int64)
        events = np.arange(n_ev, dtype=np.int64)
        marks = np.asarray([(m[4], m[3]) for m in t.marks], dtype=np.int64).reshape(-1, 2)
        first = np.concatenate([np.searchsorted(ends, events, side="right"),
                                np.arange(n_op, dtype=np.int64), marks[:, 0]])
        second = np.concatenate([events, ends, marks[:, 1]])
        kind = np.concatenate([np.full(n_ev, 1), np.full(n_op, 2), np.zeros(len(marks))])
        order = np.lexsort((kind, second, first)).tolist()
        items = [("ev", i) for i in range(n_ev)] + [("op", j) for j in range(n_op)] + \
            [("mk", m) for m in t.marks]
        self.atoms = [items[k] for k in order]

    def _contexts(self) -> None:
        """Note 1: each atom's block context."""
        ctx, current = [], GLOBAL
        block_marks = [(i, a[1]) for i, a in enumerate(self.atoms)
                       if a[0] == "mk" and a[1][0] != "window" and
                       self.slot_of_module(a[1][1]) != GLOBAL and
                       a[1][1].count(".") == self.prefix.count(".") + 1]
        entries = {i: m for i, m in block_marks}
        following = {}                      # index of a block's exit -> the next block mark
        for (i, m), nxt in zip(block_marks, block_marks[1:] + [(None, None)]):
            following[i] = nxt
        opened: list[int] = []
        for i, a in enumerate(self.atoms):
            m = entries.get(i)
            if m is not None:
                slot = self.slot_of_module(m[1])
                if m[0] == "enter":
                    opened.append(slot)
                    current = slot
                else:
                    if slot in opened:
                        del opened[len(opened) - 1 - opened[::-1].index(slot)]
                    j, nxt = following[i]
                    adjacent = nxt is not None and nxt[0] == "enter" and nxt[2] == m[2] and \
                        abs(self.slot_of_module(nxt[1]) - slot) == 1 and \
                        not any(self.atoms[x][0] == "mk" and self.atoms[x][1][0] == "window"
                                for x in range(i, j))
                    ctx.append(current)       # where it happens: the next block may run
                    gap = self.slot_of_module(nxt[1]) if adjacent and \
                        self._fetches_ahead(i, j) else slot
                    current = opened[-1] if opened else (gap if adjacent else GLOBAL)
                    continue
            ctx.append(current)
        self.context = ctx

    def _fetches_ahead(self, start: int, end: int) -> bool:
        """Note 1: atoms ``start:end`` (between two blocks) fetch a block's weights to the
        device ahead of it (``measure._labels``' ``copied``): a pre-hook of the next block."""
        led, copied = self.tracker.ledger, self.tracker.labels.copied
        return any(a[0] == "ev" and led._ev_delta[a[1]] > 0 and led._ev_sid[a[1]] in copied
                   for a in self.atoms[start:end])

    def _keys(self) -> None:
        """Note 2: each storage's label (the block whose weights it fetches ahead, else its
        block context at birth, else the tracker's, else that of the block it dies with) and
        name."""
        t = self.tracker
        led, labels = t.ledger, t.labels.of_sid
        label, kinds = {}, {}
        for sid in led._entry:
            label[sid], kinds[sid] = labels.get(sid, GLOBAL), "e"
        for a, c in zip(self.atoms, self.context):
            if a[0] == "ev":
                sid = led._ev_sid[a[1]]
                if sid not in label:
                    label[sid] = t.labels.copied.get(sid, c if c != GLOBAL else
                                                     labels.get(sid, GLOBAL))
                    kinds[sid] = "b"
        self._dies_with(label, t.labels.read)
        ranks: dict[tuple, int] = {}
        for sid, lab in label.items():
            r = ranks.get((lab, kinds[sid]), 0)
            ranks[(lab, kinds[sid])] = r + 1
            self.label[sid] = lab
            self.key[sid] = (lab, kinds[sid], r)

    def _dies_with(self, label: dict[int, int], read: set[int]) -> None:
        """A global birth no op reads takes the block of the storage that died just before it,
        in the same run of deaths (the per-layer state of a KV cache, freed layer by layer
        with the keys and values it held)."""
        led = self.tracker.ledger
        previous = GLOBAL
        for a, c in zip(self.atoms, self.context):
            if a[0] != "ev" or c != GLOBAL or led._ev_delta[a[1]] >= 0:
                previous = GLOBAL
                continue
            sid = led._ev_sid[a[1]]
            if label[sid] == GLOBAL and sid not in read and previous != GLOBAL:
                label[sid] = previous
            elif label[sid] != GLOBAL:
                previous = label[sid]

    def _effective(self) -> None:
        """Note 1: the block each atom is copied with. In a block's context, that block (a far
        host death, its storage's: Note 3); in the global context, a birth's own label, an op's
        own (or, without one, that of what it made), and a death's or a resize's, except one of
        a neighbour's storage amid the ops on a block's parameters (a single-tensor optimizer
        frees the previous parameter's temporary while it steps the next)."""
        led = self.tracker.ledger
        out, driver, born = [], GLOBAL, set()
        for i, (a, c) in enumerate(zip(self.atoms, self.context)):
            if c != GLOBAL and not self._far_death(i, c):
                out.append(c)
                driver, born = GLOBAL, set()
                continue
            if c != GLOBAL:           # Note 3: goes with the storage's own block
                out.append(self.atom_label(i))
                continue
            lab = self.atom_label(i)
            if a[0] == "ev" and (a[1] in led._resizes or led._ev_delta[a[1]] < 0):
                if driver != GLOBAL and lab != GLOBAL and abs(lab - driver) == 1:
                    lab = driver
            elif a[0] == "ev":
                born.add(lab)
                driver = lab
            elif a[0] == "op":
                if lab == GLOBAL and len(born) == 1:     # torch.tensor(0.0): no tensor input
                    lab = next(iter(born))
                driver, born = lab, set()
            out.append(lab)
        self.effective = out

    def _far_death(self, i: int, c: int) -> bool:
        """Note 3: atom ``i``, in block ``c``'s context, ends or resizes a host storage of a
        middle block two or more away from ``c``."""
        a = self.atoms[i]
        led = self.tracker.ledger
        if a[0] != "ev" or not (a[1] in led._resizes or led._ev_delta[a[1]] < 0):
            return False
        sid = led._ev_sid[a[1]]
        lab = self.label[sid]
        return sid in led._host and lab not in (GLOBAL, 0, self.depth - 1) and abs(lab - c) >= 2

    def atom_label(self, i: int) -> int:
        a = self.atoms[i]
        if a[0] == "ev":
            return self.label[self.tracker.ledger._ev_sid[a[1]]]
        if a[0] == "op":
            ops = self.tracker.labels.op_slots
            return ops[a[1]] if a[1] < len(ops) else GLOBAL
        return GLOBAL if a[1][0] == "window" else self.slot_of_module(a[1][1])
