"""A ``GradScaler`` for fake traces, and the steady state of a loss-scaled step.

``GradScaler.step`` reads ``found_inf`` back to the host to decide whether to step; a fake
tensor has no value to read. The trace assumes finite gradients (the step runs), which is the
memory-heaviest branch; everything else is the real GradScaler.

Note 1 (warm-up without a step). What a first fp16 step leaves alive for the second is what
any first step leaves (the optimizer state, the gradients until the next ``zero_grad``:
``profile.warm_up_optimizer``) plus the scaler's two scalars, its scale and growth tracker,
made on the loss's device at the first ``scale()``. Its per-step ``found_inf`` tensors are
dropped at ``update()``, and autocast's cast cache at the autocast exit. So the warm-up needs no
forward or backward: one step's trace instead of two.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.trace.profile import warm_up_optimizer

__all__ = ["TraceGradScaler", "warm_up_scaled"]


class TraceGradScaler(torch.amp.GradScaler):
    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


def warm_up_scaled(model: nn.Module, optimizer, scaler: torch.amp.GradScaler,
                   skip=frozenset()) -> None:
    """The steady state of a step under ``scaler`` (Note 1), without running one; ``skip`` as
    ``warm_up_optimizer`` takes it."""
    warm_up_optimizer(model, optimizer, skip)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    scaler.scale(torch.zeros((), device=device))      # creates the scale and growth tracker
