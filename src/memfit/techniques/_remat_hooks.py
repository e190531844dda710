"""The two pieces of a remat session that run inside the user's step: hooks, and a dispatch mode.

``PressureMode`` runs each op and, on an out-of-memory error, asks the session to evict and runs
the op again (or evicts ahead, before an op that a CPU counter would refuse after the fact).
``BlockHooks`` turns each call of one block into a ``Unit``: the forward pre-hook opens it
(the block's cache arguments dropped: a key/value cache would be written twice, by the forward
and by a recompute; its saved tensors packed by the unit), the forward hook closes it with its
outputs and FLOPs. They are the block's own module hooks, nothing assigned on the user's
modules.
"""

from __future__ import annotations

import inspect
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from memfit.measure import _counting
from memfit.techniques._remat_evict import RematBudgetTooSmall
from memfit.techniques._remat_units import Unit
from memfit.techniques.checkpoint import CACHE_ARGS

if TYPE_CHECKING:
    from memfit.techniques.remat import RematSession

__all__ = ["PressureMode", "BlockHooks"]

# ops that allocate nothing (asked often, e.g. by fake tensors): not worth a meta probe
_QUERIES = {torch.ops.prim.device.default, torch.ops.aten.sym_size.int,
            torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
            torch.ops.aten.sym_storage_offset.default, torch.ops.aten.is_contiguous.default,
            torch.ops.aten.is_contiguous.memory_format}


class PressureMode(TorchDispatchMode):
    """Runs each op; on an out-of-memory error (which left the op without effect), evicts and
    runs it again."""

    def __init__(self, session: "RematSession"):
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.session
        s.clock += 1
        if s.watched and func not in _QUERIES and not getattr(_counting._host, "depth", 0):
            s.evict_ahead(func, args, kwargs)
        while True:
            try:
                out = func(*args, **kwargs)
                counter = flop_registry.get(func._overloadpacket)
                if counter is not None:
                    s.flops += int(counter(*args, **kwargs, out_val=out))
                return out
            except RematBudgetTooSmall:          # from a recompute inside: already final
                raise
            except torch.OutOfMemoryError as e:
                if not s.make_room(e):
                    raise s.too_small(e, func) from e
                s.stats.retries += 1


class BlockHooks:
    """Forward pre/post hooks that make each call of one block a ``Unit``: a pre-hook
    (``with_kwargs``) that opens it, a hook (``always_call``, ``prepend``) that closes it."""

    def __init__(self, session: "RematSession", name: str, block: nn.Module):
        self.session, self.name = session, name
        params = inspect.signature(block.forward).parameters
        positional = [n for n, p in params.items() if p.kind in
                      (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keep_cache = getattr(block, "_can_checkpoint_with_cache", False)
        self._cache_args = () if keep_cache else tuple(   # (name, position or None): passed None
            (n, positional.index(n) if n in positional else None) for n in CACHE_ARGS
            if n in params or any(p.kind is p.VAR_KEYWORD for p in params.values()))
        self._calls: list = []     # per call in progress: (unit, hooks, FLOPs at start) or None
        self.handles = [block.register_forward_pre_hook(self.pre, with_kwargs=True),
                        block.register_forward_hook(self.post, always_call=True, prepend=True)]

    def pre(self, block: nn.Module, args: tuple, kwargs: dict):
        s = self.session
        if not torch.is_grad_enabled() or not s.open or torch._C._current_graph_task_id() != -1:
            self._calls.append(None)
            return None
        args, kwargs = list(args), dict(kwargs)
        for name, pos in self._cache_args:
            if kwargs.get(name) is not None:
                kwargs[name] = None
            if pos is not None and pos < len(args):
                args[pos] = None
        unit = Unit(s, self.name, block.forward, args, kwargs, s.outer_hooks())
        s.admit(unit)
        unit.busy = True
        hooks = torch.autograd.graph.saved_tensors_hooks(unit.pack, unit.unpack)
        hooks.__enter__()
        self._calls.append((unit, hooks, s.flops))
        return tuple(args), kwargs

    def post(self, block: nn.Module, args: tuple, out):
        entry = self._calls.pop() if self._calls else None
        if entry is None:      # not a unit (no grad, backward), or called before the hooks
            return None
        unit, hooks, start = entry
        hooks.__exit__(None, None, None)
        unit.busy = False
        if out is None and sys.exc_info()[0] is not None:
            return None        # the forward raised (``always_call``): the unit never finished
        unit.finish(out, self.session.flops - start)
        self.session.produced(unit)
        return None

    def close(self) -> None:
        """Remove the hooks; pop the saved-tensor hooks of calls a ``BaseException`` left."""
        for h in self.handles:
            h.remove()
        while self._calls:
            entry = self._calls.pop()
            if entry is not None:
                entry[1].__exit__(None, None, None)
                entry[0].busy = False
