"""bitsandbytes' 4-bit matmul as its CUDA kernel runs it: the dequantized weight it makes.

Note 1 (what differs from the CPU trace). A 4-bit layer's forward is one op,
``bitsandbytes::gemm_4bit``, whose fake kernel returns the output and nothing else. On a GPU
(bitsandbytes 0.50, ``backends/cuda/ops.py``) the op takes one of two paths by the number of
rows ``M`` of its input (tokens) and the card: a fused kernel that allocates only the output
(``M <= 4`` always; up to ``M = 1536`` where a per-architecture table prefers it), or
``_dequant_linear_fallback``: the block scales dequantized to fp32 under double quantization
(``absmax_dq``, then ``absmax_dq + offset``), the whole weight dequantized to the input's dtype
(``B_dq``: out x in values), then ``F.linear``; those temporaries live while the op runs.
``CudaBnbMode`` runs that fallback as its ops, on fakes, for every call with ``M > 4``: exact
where ``M > 1536`` (a training step's tokens, as a rule) and an upper bound by one layer's
dequantized weight below that, where the table (which needs the card's SM count) may pick the
fused kernel; the estimate's notes say which calls were counted so. The backward dequantizes
the weight again through ``bitsandbytes::dequantize_4bit``, an op of its own: the CPU trace
already counts it.

Note 2 (LLM.int8). ``bitsandbytes.matmul`` trains on the CPU with ``MatMul8bitFp`` (dequantize,
then a float matmul) and on a GPU with ``MatMul8bitLt`` (the input quantized to int8 per row, an
int32 product, outlier columns in 16 bits); the branch is taken in Python on the tensors'
device, which a trace's fakes (CPU) cannot take for a GPU. A GPU target is traced through the CPU
branch, and the note says so.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["CudaBnbMode", "FUSED_FLOOR_M", "FUSED_MAX_M"]

FUSED_FLOOR_M, FUSED_MAX_M = 4, 1536          # bitsandbytes 0.50, backends/cuda/ops.py


class CudaBnbMode(TorchFunctionMode):
    """``bitsandbytes::gemm_4bit`` as its CUDA fallback's ops (Note 1); counts the calls."""

    def __init__(self):
        super().__init__()
        ops = getattr(torch.ops, "bitsandbytes", None)
        self._gemm = getattr(ops, "gemm_4bit", None) if ops is not None else None
        self.fallback = self.bounded = self.fused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._gemm is None or func not in (self._gemm, self._gemm.default):
            return func(*args, **kwargs)
        a = args[0]
        m = a.numel() // a.shape[-1]
        if m <= FUSED_FLOOR_M:
            self.fused += 1
            return func(*args, **kwargs)
        if m > FUSED_MAX_M:
            self.fallback += 1
        else:
            self.bounded += 1
        return _dequant_linear(*args, **kwargs)

    def note(self) -> str | None:
        """The estimate's words on the 4-bit matmuls counted (Note 1), None if none ran."""
        if not (self.fallback or self.bounded or self.fused):
            return None
        parts = []
        if self.fallback:
            parts.append(f"{self.fallback} on a dequantized weight (more than {FUSED_MAX_M} "
                         "rows: bitsandbytes' fallback)")
        if self.bounded:
            parts.append(f"{self.bounded} counted with the dequantized weight although the "
                         f"card may run its fused kernel ({FUSED_FLOOR_M + 1}-{FUSED_MAX_M} "
                         "rows, by bitsandbytes' per-architecture table): an upper bound")
        if self.fused:
            parts.append(f"{self.fused} in the fused kernel (at most {FUSED_FLOOR_M} rows)")
        return "bitsandbytes 4-bit matmuls per step: " + "; ".join(parts) + \
            " (memfit.trace.cuda_bnb Note 1)"


def _dequant_linear(a, b, shape_b, absmax, blocksize, quant_type, bias=None, absmax_8bit=None,
                    absmax_code=None, absmax_offset=None):
    """bitsandbytes 0.50's ``_dequant_linear_fallback``, as ops (Note 1). It fills buffers it
    allocated with the ``.out`` kernels; the functional ops allocate the same."""
    ops = torch.ops.bitsandbytes
    if absmax_8bit is not None:
        absmax_dq = ops.dequantize_blockwise.default(absmax_8bit, absmax, absmax_code, 256,
                                                     torch.float32)
        absmax = absmax_dq + absmax_offset
    b_dq = ops.dequantize_4bit.default(b, absmax, blocksize, quant_type, list(shape_b), a.dtype)
    return torch.nn.functional.linear(a, b_dq, bias)
