"""Fakes of a batch whose dimensions are symbolic: one trace for several batch shapes.

``SymbolicCopier`` is a ``FakeCopier`` whose fake mode has a ``ShapeEnv`` (PyTorch's dynamic
shapes): every dimension of a batch tensor that equals one of ``dims``' values becomes that
dimension's symbol (``{8: "batch", 128: "seq"}``: each 8 is the batch symbol, each 128 the
length's), so the ops of the trace compute symbolic sizes, and every decision taken on a size
is recorded as a guard (``holds`` checks a shape against them). Parameters, buffers and every
other tensor keep their sizes. The batch's values are not offered to ``DataValues``: a
data-dependent op would answer with the traced batch's data, which another shape does not
have, so such an op fails the trace instead, and the shape is traced on its own.
"""

from __future__ import annotations

import sympy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._pytree import tree_flatten

from memfit.trace.fake import FakeCopier

__all__ = ["SymbolicCopier", "MAX_SIZE"]

MAX_SIZE = 2**31 - 1
"""The largest size a symbolic dimension stands for."""


class SymbolicCopier(FakeCopier):
    """Fakes with symbolic batch dimensions (module docstring)."""

    def __init__(self, device: str | torch.device, dims: dict[int, str]):
        super().__init__(device)
        if len(set(dims.values())) != len(dims) or min(dims, default=2) < 2:
            raise ValueError(f"symbolic dimensions need distinct names and sizes >= 2 (0 and 1 "
                             f"are special in PyTorch's shape rules), got {dims}")
        from torch._dynamo.source import ConstantSource

        self.shape_env = ShapeEnv()
        self.mode = FakeTensorMode(allow_non_fake_inputs=False, shape_env=self.shape_env)
        self.symbols: dict[str, sympy.Symbol] = {}
        self._storages: dict[int, bool] = {}      # batch storages seen -> holds a symbolic one
        self._sizes: dict[int, torch.SymInt] = {}
        for value, name in dims.items():
            source = ConstantSource(f"memfit_{name}")
            sym = self.shape_env.create_symbol(value, source=source,
                                               dynamic_dim=DimDynamic.DYNAMIC)
            # sizes are below 2**31: a full slice's stop (INT64_MAX) is then known to be past
            # the end, so indexing skips the slice as it does for a concrete size (without the
            # bound it records a slice op, whose backward a concrete step never runs)
            self.shape_env.constrain_symbol_range(sym, compiler_min=2, compiler_max=MAX_SIZE)
            self.symbols[name] = sym
            self._sizes[value] = self.shape_env.create_symintnode(sym, hint=value, source=source)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self._memo or t.device.type == "meta" or isinstance(t, nn.Parameter):
            return super().tensor(t)
        key = t.untyped_storage().data_ptr()
        symbolic = any(n in self._sizes for n in t.shape)
        if self._storages.get(key) or (symbolic and key in self._storages):
            raise ValueError("batch tensors that share a storage cannot be symbolic (each is "
                             "faked with a storage of its own)")
        self._storages[key] = symbolic
        if not symbolic:
            return super().tensor(t)
        if not _owns_storage(t):
            raise ValueError("a symbolic batch tensor must own a contiguous storage (a view or "
                             "a strided tensor keeps its traced layout only in its own shape)")
        with self.mode:
            fake = torch.empty([self._sizes.get(n, n) for n in t.shape], dtype=t.dtype,
                               device=self.device, requires_grad=t.requires_grad)
        self._memo[id(t)] = fake
        return fake

    def _from_real(self, t: torch.Tensor) -> torch.Tensor:
        # a real tensor that is not the batch's (a weight) keeps its sizes: the fake mode would
        # make each of its dimensions a symbol of its own
        return self.mode.from_tensor(t, static_shapes=True)

    def holds(self, values: dict[str, int]) -> bool:
        """Whether the trace's guards hold in the shape ``values`` (name -> size): then the
        trace would take the same branches there."""
        if set(values) != set(self.symbols) or not all(2 <= v <= MAX_SIZE for v in values.values()):
            return False
        subs = {self.symbols[n]: sympy.Integer(v) for n, v in values.items()}
        env = self.shape_env
        conditions = [g.expr for g in env.guards]
        conditions += [sympy.Eq(s, r) for s, r in env.replacements.items()]
        conditions += [ra.expr for asserts in env.deferred_runtime_asserts.values()
                       for ra in asserts]
        return all(c.xreplace(subs) == sympy.true for c in conditions)

    def same_batch(self, traced, batch, values: dict[str, int]) -> bool:
        """Whether ``batch`` is the traced batch ``traced`` in the shape ``values``: the same
        structure, dtypes and non-tensor leaves, and each tensor's sizes those of its fake in
        that shape (a dimension that is not symbolic, e.g. a decoder's length derived from the
        batch's length, would keep its traced size in the replay)."""
        a, spec_a = tree_flatten(traced)
        b, spec_b = tree_flatten(batch)
        if spec_a != spec_b:
            return False
        storages = [y.untyped_storage().data_ptr() for y in b if isinstance(y, torch.Tensor)]
        if len(set(storages)) != len(storages):
            return False                  # shared storages: the traced batch had none
        value = self.sizes(values)
        for x, y in zip(a, b):
            if not isinstance(x, torch.Tensor):
                if isinstance(y, torch.Tensor) or x != y:
                    return False
                continue
            fake = self._memo.get(id(x))
            if not isinstance(y, torch.Tensor) or fake is None or x.dtype != y.dtype or \
                    fake.dim() != y.dim() or not _owns_storage(y):
                return False              # (a strided tensor counts its whole storage)
            for n, m in zip(fake.shape, y.shape):
                if (value(n.node.expr) if isinstance(n, torch.SymInt) else n) != m:
                    return False
        return True

    def sizes(self, values: dict[str, int]):
        """``value(expr) -> int`` in the shape ``values``, for ``Ledger.device_events``."""
        subs = {self.symbols[n]: sympy.Integer(v) for n, v in values.items()}
        done: dict = {}

        def value(e) -> int:
            if isinstance(e, int):
                return e
            if e not in done:
                out = e.xreplace(subs)
                if not out.is_number:
                    raise ValueError(f"a size depends on more than {sorted(values)}: {e}")
                done[e] = int(out)
            return done[e]
        return value


def _owns_storage(t: torch.Tensor) -> bool:
    """``t`` is its whole storage, laid out contiguously: its bytes are its elements'."""
    return t.is_contiguous() and t.storage_offset() == 0 and \
        t.untyped_storage().nbytes() == t.numel() * t.element_size()
