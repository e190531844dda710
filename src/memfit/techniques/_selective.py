"""Selective recompute's two dispatch modes: keep what matmul-like ops return, recompute the rest.

Note 1 (why not torch's ``create_selective_checkpoint_contexts``). Torch's pair keeps the output
of every op its policy saves and hands that tensor back in the recompute. Two steps it cannot run:
(a) a kept output that the forward then changes in place. timm's ``SqueezeExcite`` applies
``SiLU(inplace=True)`` straight to ``conv_reduce``'s output (EfficientNet, MobileNetV3, RegNet's
SE); ``Linear`` -> ``ReLU(inplace=True)`` (VGG, AlexNet heads), ``y += x`` on a matmul's output do
the same. The kept tensor then holds the mutated values, the recompute would apply the in-place
op a second time, and torch refuses in backward ("Tensor cached during selective activation
checkpoint has been mutated"). A policy cannot help: it is asked when the op runs, before the
mutation. (b) The first recompute consumes the kept tensors, so a second backward through the
block (a gradient penalty: ``autograd.grad(..., create_graph=True)`` then ``backward()``; any
``retain_graph=True``) raises "Trying to backward an extra time". (A conv -> BatchNorm -> in-place
SiLU stack is fine under torch's pair: BatchNorm's output is new, the conv's is not touched.)

Note 2 (what these modes do). ``_KeepMode`` (the forward context) runs every op; for a
non-mutating overload of an op in ``saved_ops`` it keeps a detached alias of the output that
shares its version counter (as torch's ``_detach_helper``: detached with ADInplaceOrView enabled,
which is what shares the counter), with the version it had. Autograd bumps the version of an
in-place op's argument after the op's kernel returns, so after an op that writes to an argument
the next op (or leaving the block) looks at the kept entries and drops every one whose version
moved: that op is recomputed like any other, and the block keeps no more than ``recompute``
would for it. ``_ReplayMode`` (the recompute context) counts the same ops in the same order; an
entry still intact is handed back once and released (as torch's). Anything else is recomputed
from its recomputed inputs: an entry dropped in the forward, one mutated after the block
returned (the caller's ``relu_`` on a block output), one an earlier backward already took (the
second backward of Note 1 (b)). The same kernel on the same values gives the same bits, so the
gradients stay bitwise those of the plain step (the oracle of ``tests/techniques``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["selective_contexts"]


def selective_contexts(saved_ops: frozenset) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """(forward context, recompute context) for one checkpointed call; ``saved_ops`` holds
    op overload packets (``torch.ops.aten.mm``) whose outputs the forward keeps."""
    kept: dict = defaultdict(dict)      # op overload -> call index -> _Kept (or None: dropped)
    return _KeepMode(saved_ops, kept), _ReplayMode(saved_ops, kept)


def _writes(func) -> bool:
    """The op writes to an argument (an in-place or ``out=`` overload)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and schema.is_mutable


def _keeps(func, saved_ops: frozenset) -> bool:
    return getattr(func, "overloadpacket", None) in saved_ops and not _writes(func)


def _alias(x):
    """A detached alias sharing ``x``'s version counter (Note 2), as torch's ``_detach_helper``."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


class _Kept:
    """One kept output (a pytree of detached aliases) and the versions its tensors had."""

    __slots__ = ("out", "versions")

    def __init__(self, out):
        self.out = tree_map(_alias, out)
        self.versions = self._now()

    def _now(self) -> list[int]:
        return [t._version for t in tree_leaves(self.out) if isinstance(t, torch.Tensor)]

    def intact(self) -> bool:
        return self._now() == self.versions


class _KeepMode(TorchDispatchMode):
    """The forward context: keep what ``saved_ops`` return, drop what is mutated (Note 2)."""

    def __init__(self, saved_ops: frozenset, kept: dict):
        super().__init__()
        self.saved_ops, self.kept = saved_ops, kept
        self._calls: dict = defaultdict(int)     # op overload -> calls so far
        self._wrote = False                      # the last op wrote to an argument

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._wrote:
            self._drop_mutated()
        out = func(*args, **(kwargs or {}))
        self._wrote = _writes(func)
        if _keeps(func, self.saved_ops):
            i = self._calls[func]
            self._calls[func] += 1
            self.kept[func][i] = _Kept(out)
        return out

    def __exit__(self, *exc):
        if self._wrote:
            self._drop_mutated()
        return super().__exit__(*exc)

    def _drop_mutated(self) -> None:
        self._wrote = False
        for calls in self.kept.values():
            for i, entry in calls.items():
                if entry is not None and not entry.intact():
                    calls[i] = None


class _ReplayMode(TorchDispatchMode):
    """The recompute context: hand back each intact kept output once, rerun the rest (Note 2)."""

    def __init__(self, saved_ops: frozenset, kept: dict):
        super().__init__()
        self.saved_ops, self.kept = saved_ops, kept
        self._calls: dict = defaultdict(int)

    def __enter__(self):
        self._calls.clear()        # each recompute replays the block from its first op
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _keeps(func, self.saved_ops):
            i = self._calls[func]
            self._calls[func] += 1
            entry = self.kept.get(func, {}).pop(i, None)
            if entry is not None and entry.intact():
                return entry.out
        return func(*args, **(kwargs or {}))
