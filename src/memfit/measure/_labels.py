"""Which repeated block each storage and op of a trace belongs to (``trace.block_reuse``).

A tracker given the model's block names (``Tracker(blocks=...)``) labels every storage it counts
with the index of the block it belongs to, or ``GLOBAL``; the composition of a deep model's step
from a shallow twin's (``trace.block_reuse``) repeats what one middle block labels.

Note 1 (the rules). A storage born while a block's module runs (forward, backward, a
recompute) is that block's. Elsewhere (the embeddings, the loss, the optimizer step,
``zero_grad``) an op's outputs take the one block label its tensor inputs carry, if they carry
exactly one (a single-tensor optimizer's temporaries: the parameter's block), and the
``GLOBAL`` label otherwise; a ``_foreach_`` op's i-th output takes the label of its first list's
i-th tensor (a foreach optimizer step over all parameters). Storages that belong to a block's
parameters (the parameter, its attached state, its gradient, its optimizer state, an
optimizer's own copy of it) take that block's label, found at the region's start and end (a
per-parameter ``torch.tensor(0.0)`` step counter has no tensor input); so the labels are
resolved at the end, from what each op read and made. A global birth that one block alone
reads is that block's (a KV cache's per-layer counters, made before the first block runs).

Note 2 (fetched ahead). An op that copies host storages of one block to the device (it reads
only host storages that block's parameters own, or that were made as that block's, and makes
device ones), run while another block runs or between blocks, makes storages of the block it
read: parameter offload fetching a block's weights from their host twins ahead of its use (the
next block's in forward, the previous one's in backward), activation offload bringing a
block's saved tensors back while backward runs the block after it. They are kept in
``copied``: ``trace._step_log`` names them by that block, not by where they were made (named by
where, the block after the first of a LoRA model held fewer: the first block's input needs no
gradient, so it saved less). Host-to-host copies (gradients moved to the host) and device ops
(a step in backward) keep the usual rules.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.measure._leaves import leaves
from memfit.measure.attached import attached_tensors, module_tensors

__all__ = ["StorageLabels", "GLOBAL"]

GLOBAL = -1


class StorageLabels:
    """Block labels of a ledger's storages and of a tracker's ops (Note 1): what each op read
    and made is kept as it runs, and ``resolve`` labels them once the region is over, when
    every storage's owner is known (a step counter born in the first step is read in the
    second)."""

    def __init__(self, blocks: Sequence[str]):
        self.blocks = list(blocks)
        self.slot_of = {name: i for i, name in enumerate(self.blocks)}
        self.owned: dict[int, int] = {}      # storage id -> the block whose parameter owns it
        # per counted op: (running block, input storage ids, foreach (input, output) pairs,
        # storage ids it made, whether it copies host storages to the device: Note 2)
        self.ops: list[tuple[int, tuple, tuple, tuple, bool]] = []
        self.of_sid: dict[int, int] = {}
        self.copied: dict[int, int] = {}     # storage id -> the other block it was made from
        self.op_slots: list[int] = []
        self.read: set[int] = set()          # storage ids some op read

    def slot_running(self, stack: list[str]) -> int:
        """The block whose module is running (innermost), or ``GLOBAL``."""
        for name in reversed(stack):
            slot = self.slot_of.get(name)
            if slot is not None:
                return slot
        return GLOBAL

    def own(self, model: nn.Module | None, optimizer, ledger) -> None:
        """Note the storages of each block's parameters, gradients, buffers and optimizer
        state (Note 1)."""
        if model is None:
            return
        slot_of_param: dict[int, int] = {}
        for slot, name in enumerate(self.blocks):
            block = model.get_submodule(name)
            for p in block.parameters():
                slot_of_param[id(p)] = slot
            self._note(ledger, _owned(block), slot)
        while optimizer is not None:        # a wrapper's inner optimizer holds host twins
            for q, slot in _optimizer_params(model, optimizer, slot_of_param):
                state = optimizer.state.get(q, {}) if hasattr(optimizer, "state") else {}
                self._note(ledger, [q, q.grad, *tree_flatten(state)[0]], slot)
            inner = getattr(optimizer, "inner", None)
            optimizer = inner if hasattr(inner, "param_groups") else None

    def _note(self, ledger, tensors, slot: int) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st in ledger.storages(t):
                    sid = ledger.sid(st)
                    if sid is not None:       # one several blocks hold (a code book) is global
                        self.owned[sid] = slot if self.owned.get(sid, slot) == slot else GLOBAL

    def born(self, ledger, stack: list[str], func, args, kwargs, out, new) -> None:
        """Keep what ``func`` read and made (``new``: its new storages)."""
        pairs = ()
        if func._overloadpacket.__name__.startswith("_foreach_") and args and \
                isinstance(args[0], (list, tuple)) and isinstance(out, (list, tuple)):
            pairs = tuple((_sids(ledger, [src]), _sids(ledger, [x])) for x, src in zip(out, args[0]))
        inputs = _sids(ledger, leaves((args, kwargs)))
        made = tuple(ledger.sid(st) for st in new)
        fetch = bool(inputs) and bool(made) and all(sid in ledger._host for sid in inputs) \
            and not any(sid in ledger._host for sid in made)      # host to device (Note 2)
        self.ops.append((self.slot_running(stack), inputs, pairs, made, fetch))

    def resolve(self) -> None:
        """Label every storage and op (Note 1), in the order the ops ran; a global birth that
        the ops of one block alone read is that block's, and its readers' outputs follow."""
        found: dict[int, int] = {}
        for _ in range(4):
            labels, slots, readers, copied = self._pass({**self.owned, **found})
            more = {sid: next(iter(who)) for sid, who in readers.items()
                    if len(who) == 1 and GLOBAL not in who and sid not in found}
            if not more:
                break
            found.update(more)
        self.of_sid, self.op_slots, self.copied = labels, slots, copied

    def _pass(self, known: dict[int, int]):
        labels, slots, copied = dict(known), [], {}
        readers: dict[int, set[int]] = {}        # a global birth -> the labels of its readers
        for running, inputs, pairs, new, fetch in self.ops:
            lab = running
            owners = {self.owned.get(sid, labels.get(sid)) for sid in inputs} if fetch else ()
            j = next(iter(owners)) if len(owners) == 1 else None
            if j not in (None, GLOBAL, running):     # Note 2: a block's storages fetched ahead
                copied.update((sid, j) for sid in new)
                if running != GLOBAL:
                    lab = j
            if running == GLOBAL:
                seen = {labels.get(sid, GLOBAL) for sid in inputs} - {GLOBAL}
                lab = seen.pop() if len(seen) == 1 else GLOBAL
                for src, made in pairs:
                    src_lab = {labels.get(sid, GLOBAL) for sid in src} - {GLOBAL}
                    for sid in made:
                        labels.setdefault(sid, src_lab.pop() if len(src_lab) == 1 else GLOBAL)
            for sid in new:
                labels.setdefault(sid, lab)
            slots.append(lab)
            self.read.update(inputs)
            for sid in inputs:
                if labels.get(sid, GLOBAL) == GLOBAL and sid not in self.owned and sid in labels:
                    readers.setdefault(sid, set()).add(lab)
        return labels, slots, readers, copied


def _sids(ledger, tensors) -> tuple[int, ...]:
    out = []
    for x in tensors:
        if isinstance(x, torch.Tensor):
            for st in ledger.storages(x):
                sid = ledger.sid(st)
                if sid is not None:
                    out.append(sid)
    return tuple(out)


def _owned(block: nn.Module) -> Iterator[torch.Tensor]:
    for p in block.parameters():
        yield p
        yield from attached_tensors(p)
        if p.grad is not None:
            yield p.grad
    yield from block.buffers()
    for m in block.modules():
        yield from module_tensors(m)


def _optimizer_params(model: nn.Module, optimizer, slot_of_param: dict[int, int]):
    """(optimizer parameter, its block) for those of a block: a model's parameter, or the
    optimizer's own copy of one (fp32 master weights, an offloaded optimizer's host twins),
    paired with the model's trainable parameters in order where the optimizer holds one per
    parameter."""
    groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
    if not groups:
        return
    held = [q for g in groups for q in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    copies = len(held) == len(trainable) and any(id(q) not in slot_of_param for q in held)
    for i, q in enumerate(held):
        slot = slot_of_param.get(id(q))
        if slot is None and copies:
            slot = slot_of_param.get(id(trainable[i]))
        if slot is not None:
            yield q, slot
