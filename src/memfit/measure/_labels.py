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
parameters (the parameter, its attached state, its gradient, its optimizer state) take that
block's label at the region's start, and at its end for those born unlabeled in between (a
per-parameter ``torch.tensor(0.0)`` step counter has no tensor input).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.measure.attached import attached_tensors, module_tensors

__all__ = ["StorageLabels", "GLOBAL"]

GLOBAL = -1


class StorageLabels:
    """Block labels of a ledger's storages (by storage id) and of a tracker's ops (Note 1)."""

    def __init__(self, blocks: Sequence[str]):
        self.blocks = list(blocks)
        self.slot_of = {name: i for i, name in enumerate(self.blocks)}
        self.of_sid: dict[int, int] = {}
        self.op_slots: list[int] = []      # per counted op: its block, or its inputs' label

    def slot_running(self, stack: list[str]) -> int:
        """The block whose module is running (innermost), or ``GLOBAL``."""
        for name in reversed(stack):
            slot = self.slot_of.get(name)
            if slot is not None:
                return slot
        return GLOBAL

    def own(self, model: nn.Module | None, optimizer, ledger, fill_only: bool) -> None:
        """Label the storages of each block's parameters, gradients, buffers and optimizer
        state (Note 1); ``fill_only``: only those still unlabeled."""
        if model is None:
            return
        for slot, name in enumerate(self.blocks):
            for t in _owned(model.get_submodule(name), optimizer):
                for st in ledger.storages(t):
                    sid = ledger.sid(st)
                    if sid is not None and (not fill_only or
                                            self.of_sid.get(sid, GLOBAL) == GLOBAL):
                        self.of_sid[sid] = slot

    def born(self, ledger, stack: list[str], func, args, kwargs, out, new) -> None:
        """Label the storages ``func`` returned (``new``) and the op itself (Note 1)."""
        slot = self.slot_running(stack)
        if slot == GLOBAL:
            slot = self._label_of(ledger, tree_flatten((args, kwargs))[0])
            if func._overloadpacket.__name__.startswith("_foreach_") and args and \
                    isinstance(args[0], (list, tuple)) and isinstance(out, (list, tuple)):
                for x, src in zip(out, args[0]):
                    lab = self._label_of(ledger, [src])
                    if isinstance(x, torch.Tensor):
                        for st in ledger.storages(x):
                            sid = ledger.sid(st)
                            if sid is not None and sid not in self.of_sid:
                                self.of_sid[sid] = lab
        for st in new:
            sid = ledger.sid(st)
            if sid is not None and sid not in self.of_sid:
                self.of_sid[sid] = slot
        self.op_slots.append(slot)

    def _label_of(self, ledger, tensors) -> int:
        labels = set()
        for x in tensors:
            if isinstance(x, torch.Tensor):
                for st in ledger.storages(x):
                    sid = ledger.sid(st)
                    if sid is not None:
                        labels.add(self.of_sid.get(sid, GLOBAL))
        labels.discard(GLOBAL)
        return labels.pop() if len(labels) == 1 else GLOBAL


def _owned(block: nn.Module, optimizer) -> Iterator[torch.Tensor]:
    state = getattr(optimizer, "state", {}) if optimizer is not None else {}
    for p in block.parameters():
        yield p
        yield from attached_tensors(p)
        if p.grad is not None:
            yield p.grad
        if p in state:
            yield from (v for v in tree_flatten(state[p])[0] if isinstance(v, torch.Tensor))
    yield from block.buffers()
    for m in block.modules():
        yield from module_tensors(m)
