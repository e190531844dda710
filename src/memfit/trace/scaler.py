"""A ``GradScaler`` for fake traces.

``GradScaler.step`` reads ``found_inf`` back to the host to decide whether to step; a fake
tensor has no value to read. The trace assumes finite gradients (the step runs), which is the
memory-heaviest branch; everything else is the real GradScaler.
"""

from __future__ import annotations

import torch

__all__ = ["TraceGradScaler"]


class TraceGradScaler(torch.amp.GradScaler):
    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)
