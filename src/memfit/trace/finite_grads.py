"""A GradScaler's inf check in a fake trace: the gradients are taken to be finite.

``GradScaler.unscale_`` runs ``aten._amp_foreach_non_finite_check_and_unscale_``, which writes
``found_inf`` (1 if any gradient is inf/NaN, else 0), and ``GradScaler.step`` reads it back
(``found_inf.item()``) to decide whether the optimizer steps. A fake tensor has no value, so a
user's own step with a real ``torch.amp.GradScaler`` would stop there. ``FiniteGradsMode``
records, after each such check, that ``found_inf`` holds 0 (``DataValues.link``), so the read
resolves as the real one does on finite gradients: the optimizer steps, the memory-heaviest
branch and the one a steady-state step takes (memfit's own trace assumes the same:
``trace.scaler.TraceGradScaler``). Nothing else is changed; the op itself runs on the fakes.

It sits above ``FidelityMode`` (``trace.profile``), so its link comes after FidelityMode has
marked the written ``found_inf`` unknown.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.measure._compile_aware import CompileAware
from memfit.measure._counting import fake_device
from memfit.trace.data_dependent import DataValues, real_values

__all__ = ["FiniteGradsMode"]

_DEVICE = torch.ops.prim.device.default
_CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default


class FiniteGradsMode(CompileAware, TorchDispatchMode):
    """After each GradScaler inf check on fakes, ``found_inf`` is known to be 0."""

    def __init__(self, data: DataValues):
        super().__init__()
        self.data = data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and isinstance(args[0], FakeTensor):  # the top mode of a warm-up
            return fake_device(args[0])           # answers it, as the counter does in a step
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _CHECK:
            found_inf = args[1] if len(args) > 1 else kwargs["found_inf"]
            if isinstance(found_inf, FakeTensor):
                with real_values():
                    zero = torch.zeros(found_inf.shape, dtype=found_inf.dtype)
                self.data.link(found_inf, zero)
        return out
