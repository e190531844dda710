"""A GradScaler's inf check in a fake trace: the gradients are taken to be finite.

``GradScaler.unscale_`` runs ``aten._amp_foreach_non_finite_check_and_unscale_``, which writes
``found_inf`` (1 if any gradient is inf/NaN, else 0), and ``GradScaler.step`` reads it back
(``found_inf.item()``) to decide whether the optimizer steps. A fake tensor has no value, so a
user's own step with a real ``torch.amp.GradScaler`` would stop there. The fidelity mode
(``trace.fidelity``) records, after each such check, that ``found_inf`` holds 0
(``after``: ``DataValues.link``), so the read
resolves as the real one does on finite gradients: the optimizer steps, the memory-heaviest
branch and the one a steady-state step takes (memfit's own trace assumes the same:
``trace.scaler.TraceGradScaler``). Nothing else is changed; the op itself runs on the fakes.

The link comes after the fidelity mode has marked the written ``found_inf`` unknown. (It was a
dispatch mode of its own above the fidelity mode; one mode less is 3% of a trace.)
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.measure._counting import fake_device
from memfit.trace.data_dependent import DataValues, real_values

__all__ = ["DEVICE", "CHECK", "device_of", "after"]

DEVICE = torch.ops.prim.device.default
CHECK = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default   # the inf check


def device_of(args):
    """``prim.device`` (``DEVICE``) of a fake, as the counter answers it in a step, where the
    fidelity mode is the top one (a warm-up); None for a real tensor."""
    return fake_device(args[0]) if isinstance(args[0], FakeTensor) else None


def after(args, kwargs, data: DataValues) -> None:
    """After a GradScaler inf check (``CHECK``) on fakes, ``found_inf`` is known to be 0
    (called once the op has run and its outputs were marked unknown)."""
    found_inf = args[1] if len(args) > 1 else kwargs["found_inf"]
    if isinstance(found_inf, FakeTensor):
        with real_values():
            zero = torch.zeros(found_inf.shape, dtype=found_inf.dtype)
        data.link(found_inf, zero)
