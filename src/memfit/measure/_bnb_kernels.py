"""bitsandbytes' optimizer ops on CPU tensors, run as its registered CPU kernels in Python.

Note 1 (why). bitsandbytes' optimizer update is a custom op (``optimizer_update_8bit_blockwise``,
``optimizer_update_32bit``). On CPU its registered kernel is Python (``backends/cpu/ops.py``):
it dequantizes the moments to fp32, makes an fp32 gradient and the denominator, and
requantizes, 20 bytes per value of the 8-bit parameter it steps at its peak. Behind the op
those temporaries are invisible to a dispatch mode (``track``'s counter, the fake trace) but
not to the allocator. ``CpuKernels`` (a ``TorchFunctionMode``) calls that same registered
function as Python instead of the op, on CPU tensors only: the same ops and numbers, every
temporary one a counter sees. ``track`` enters it over a real run (a user's own bitsandbytes
optimizer), the low-bit technique around its own step (its CPU step runs bitsandbytes'
registered kernel; on CUDA the op allocates nothing).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CpuKernels", "cpu_kernels"]


class CpuKernels(TorchFunctionMode):
    """bitsandbytes' optimizer ops on CPU tensors run its registered CPU kernels (Note 1)."""

    def __init__(self, cpu_ops):
        super().__init__()
        ops = torch.ops.bitsandbytes
        self.kernels = {}
        for op, kernel in ((ops.optimizer_update_8bit_blockwise,
                            cpu_ops._optimizer_update_8bit_blockwise_cpu),
                           (ops.optimizer_update_32bit, cpu_ops._optimizer_update_32bit_cpu)):
            self.kernels[op] = self.kernels[op.default] = kernel    # called as packet or overload

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kernel = self.kernels.get(func)
        if kernel is not None and all(a.device.type == "cpu" for a in args
                                      if isinstance(a, torch.Tensor)):
            return kernel(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def cpu_kernels():
    """``CpuKernels`` where bitsandbytes (>= 0.50, with CPU optimizer kernels) is already
    imported, else a no-op context: nothing can call its ops before it is imported."""
    cpu_ops = sys.modules.get("bitsandbytes.backends.cpu.ops")
    if cpu_ops is None or not hasattr(cpu_ops, "_optimizer_update_8bit_blockwise_cpu"):
        return contextlib.nullcontext()
    return CpuKernels(cpu_ops)
