"""Where a fake kernel's outputs differ from the real kernel's, make them agree.

A fake tensor's shape and dtype come from the op's meta function. Where a meta function and
the real CPU kernel disagree on an output's dtype, size or strides, or where the meta function
refuses what the CPU kernel runs, the fake trace would count other bytes than the real step (or
stop). Each rule below fixes one such op, names the real kernel it copies, and is checked by a
test that runs the real op beside the fake one (tests/trace/test_fidelity.py).

Rule 1 (batch norm, mixed dtypes). Under autocast a conv hands batch norm a bf16/fp16 input
while its affine parameters and running stats stay fp32. The CPU kernel then computes in fp32
and returns ``save_mean``/``save_invstd`` in fp32 (``batch_norm_cpu``: ``param_scalar_type``
of a mixed-type call); the meta function returns them in the input's dtype.

Rule 2 (grouped matmul in fp32/fp16). ``aten._grouped_mm`` (MoE experts: transformers'
``grouped_mm`` experts path, Qwen2-MoE, Mixtral, ...) has a meta function that copies the CUDA
kernel's checks and refuses anything but bf16, while the CPU kernel (the trace is a CPU trace)
runs fp32 and fp16 too, forward and backward, and returns a contiguous tensor of the inputs'
dtype (``_grouped_mm`` CPU: one mm per group into ``at::empty``). For those dtypes the rule
makes that output; the shapes follow the meta function's (2D x 3D -> (M, N); 3D x 2D -> (M, N);
2D x 2D -> (G, M, N); 3D x 3D -> (G, M, N)).

Rule 3 (layer norm backward, strides). ``layer_norm_backward_cpu`` allocates ``grad_input``
contiguous whatever the strides of ``grad_out``; the meta decomposition gives it
``grad_out``'s strides. A transposed gradient (Swin's patch merging) then made the next
``reshape`` copy in the trace and not in the real step.

Rule 4 (layer and group norm, mixed dtypes). Rule 1's case for the other norms: a bf16/fp16
input with fp32 affine parameters (CPU autocast leaves ``layer_norm`` alone, so a norm after a
bf16 matmul or conv gets one: ModernBERT's, Swin's) makes ``layer_norm_cpu`` /
``group_norm_cpu`` return ``mean``/``rstd`` in fp32 (their ``mixed_type`` path); the meta
functions return them in the input's dtype.

Rule 5 (losses that keep their unreduced buffer). Four losses, reduced ("mean" or "sum"),
return a 0-d tensor whose storage is the whole unreduced loss, alive as long as the loss is
(until backward frees it): the real kernel allocates the elementwise loss as its output, then
shrinks the output to 0-d with ``resize_``, which never gives memory back. ``mse_loss`` and
``smooth_l1_loss`` do it in their structured meta function (``build_borrowing_binary_op`` then
``resize_({})``: the one meta function of the CPU and CUDA kernels); ``binary_cross_entropy``
in ``binary_cross_entropy_cpu`` and ``_cuda`` alike (``empty_like(input)``, then
``loss.resize_as_(loss_reduced)``); ``soft_margin_loss`` in its composite ``_out`` (``neg_out``
into the output, then ``resize_({})``). The fake kernels return a fresh 4-byte scalar. The rule
gives the fake output the unreduced loss's storage (broadcast of input and target, in the
output's dtype), shrunk the same way. The other losses and reductions were audited against the
real CPU kernels (every op of torch's ``op_db``, forward and backward: fake and real storage
bytes of each new output; tests/trace/test_fidelity.py keeps the losses and reductions) and
agree: ``huber_loss``, ``l1_loss``, the cross-entropies, ``kl_div``, ... return a reduction's
fresh output.

Data-dependent ops (``nonzero``, ``unique``, ``masked_select``, boolean indexing, ``.item()``)
are resolved from the real batch by ``memfit.trace.data_dependent`` when ``FidelityMode`` is
given its ``DataValues``; so is a GradScaler's inf check, taken to find the gradients finite
(``trace.finite_grads``).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.measure._compile_aware import CompileAware
from memfit.trace import finite_grads
from memfit.trace.data_dependent import DataValues

__all__ = ["FidelityMode"]

_aten = torch.ops.aten
_REDUCED = (torch.bfloat16, torch.float16)
_GROUPED_MM_CPU_DTYPES = (torch.float32, torch.float16)


def _batch_norm_mixed(args, kwargs, out):
    """Rule 1."""
    x, params = args[0], args[1:5]
    if x.dtype not in _REDUCED:
        return out
    if not any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params):
        return out
    y, mean, invstd = out
    return y, mean.to(torch.float32), invstd.to(torch.float32)


def _norm_mixed(x, params, out):
    """Rule 4: ``out`` is (y, mean, rstd)."""
    if x.dtype not in _REDUCED or not any(isinstance(p, torch.Tensor) and p.dtype == torch.float32
                                          for p in params):
        return out
    y, mean, rstd = out
    return y, mean.to(torch.float32), rstd.to(torch.float32)


def _layer_norm_backward_contiguous(args, kwargs, out):
    """Rule 3."""
    grad_input, *rest = out
    if grad_input is None or grad_input.is_contiguous() or grad_input.device.type != "cpu":
        return out
    return (torch.empty(grad_input.shape, dtype=grad_input.dtype, device=grad_input.device), *rest)


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs) -> list[int]:
    """Rule 2: the output size ``_create_grouped_mm_output_tensor`` gives."""
    if a.dim() == 2 and b.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)]
    if a.dim() == 2:
        return [a.size(0), b.size(-1)]
    if b.dim() == 2:
        return [a.size(1), b.size(1)]
    return [a.size(0), a.size(1), b.size(-1)]


def _grouped_mm_cpu(func, args, kwargs):
    """Rule 2; ``None`` where the meta function is right (bf16, or not a CPU fp32/fp16 call)."""
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args)) | kwargs
    a, b, offs = bound["mat_a"], bound["mat_b"], bound.get("offs")
    if (a.dtype not in _GROUPED_MM_CPU_DTYPES or b.dtype != a.dtype or a.device.type != "cpu"
            or bound.get("bias") is not None or a.dim() not in (2, 3) or b.dim() not in (2, 3)
            or ((a.dim() == 2 or b.dim() == 2) and offs is None)):
        return None
    out_dtype = bound.get("out_dtype") or a.dtype
    return torch.empty(_grouped_mm_shape(a, b, offs), dtype=out_dtype, device=a.device)


def _keeps_unreduced(reduction_at: int):
    """Rule 5, for a loss whose ``reduction`` argument is positional argument ``reduction_at``."""
    def rule(args, kwargs, out):
        reduction = kwargs.get("reduction", args[reduction_at] if len(args) > reduction_at else 1)
        if reduction == 0:                       # "none": the output is the unreduced loss
            return out
        unreduced = torch.broadcast_shapes(args[0].shape, args[1].shape)
        buffer = torch.empty(unreduced, dtype=out.dtype, device=out.device)
        return buffer.resize_(out.shape)         # storage kept, as the real kernel's resize_
    return rule


_RULES = {
    _aten.native_batch_norm.default: _batch_norm_mixed,
    _aten._native_batch_norm_legit.default: _batch_norm_mixed,
    _aten.native_layer_norm_backward.default: _layer_norm_backward_contiguous,
    _aten.native_layer_norm.default: lambda args, kwargs, out: _norm_mixed(args[0], args[2:4], out),
    _aten.native_group_norm.default: lambda args, kwargs, out: _norm_mixed(args[0], args[1:3], out),
    _aten.mse_loss.default: _keeps_unreduced(2),
    _aten.smooth_l1_loss.default: _keeps_unreduced(2),
    _aten.soft_margin_loss.default: _keeps_unreduced(2),
    _aten.binary_cross_entropy.default: _keeps_unreduced(3),
}
_REPLACEMENTS = {_aten._grouped_mm.default: _grouped_mm_cpu}


class FidelityMode(CompileAware, TorchDispatchMode):
    """Sits between the counter and the fake mode; rewrites outputs of the ops in ``_RULES``,
    runs the ops of ``_REPLACEMENTS`` as the CPU kernel would, and, given ``data`` (the real
    values of the batch's integer tensors), resolves data-dependent ops from them."""

    def __init__(self, data: DataValues | None = None):
        super().__init__()
        self.data = data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is finite_grads.DEVICE:
            device = finite_grads.device_of(args)
            if device is not None:
                return device
        kwargs = kwargs or {}
        replace = _REPLACEMENTS.get(func)
        out = replace(func, args, kwargs) if replace is not None else None
        if out is None:
            out = self._run(func, args, kwargs)
        rule = _RULES.get(func)
        return out if rule is None else rule(args, kwargs, out)

    def _run(self, func, args, kwargs):
        if self.data is None:
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except (torch._subclasses.fake_tensor.DynamicOutputShapeException,
                torch._subclasses.fake_tensor.DataDependentOutputException):
            out = self.data.resolve(func, args, kwargs)
            if out is None:
                raise
            return out
        self.data.propagate(func, args, kwargs, out)
        if func is finite_grads.CHECK:
            finite_grads.after(args, kwargs, self.data)
        return out
