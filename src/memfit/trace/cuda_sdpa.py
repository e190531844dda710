"""CUDA's fused attention kernels, modelled on the CPU: their outputs, saved tensors and workspace.

``CudaSdpaMode`` intercepts ``F.scaled_dot_product_attention``, picks the backend a CUDA GPU
would run (``cuda_sdpa_select.select_backend``), and runs a custom op pair (``memfit::sdpa_fwd``,
``memfit::sdpa_bwd``) whose outputs have the sizes, dtypes and layouts that backend's kernels
allocate. Sources are PyTorch 2.13's ``aten/src/ATen/native/transformers/attention.cpp``
(the composite), ``cuda/attention.cu``, ``cuda/attention_backward.cu``, ``cuda/flash_attn/
flash_api.cpp``, ``cuda/mem_eff_attention/kernel_backward.h``, ``derivatives.yaml`` and the
meta functions in ``torch/_meta_registrations.py``.

Note 1 (why custom ops). A live-bytes counter sees storages at op boundaries. A custom op with
a fake and a real CPU implementation is one such boundary: under ``FakeTensorMode`` its fake
implementation allocates exactly what the CUDA kernel returns; on real CPU tensors the same
buffers are filled with true values (computed in fp32, Note 5), so results and gradients can
be checked against plain SDPA. Buffers a kernel allocates and frees inside itself are returned
as extra "workspace" outputs that the caller drops at once: the counter sees them born and die
inside the op, as the caching allocator does.

Note 2 (what each backend allocates). B batch, H query heads, Hk key/value heads, L and S
query and key lengths, D and Dv head dims, r(x, m) = x rounded up to a multiple of m.
- flash fwd (``mha_fwd``): out = ``empty_like(q)`` (q padded to a multiple of 8, Note 3);
  softmax_lse [B, H, L] fp32; rng_state [2] uint64 and an unused [] uint64, both on the GPU.
  Not modelled: the split-KV buffers ``set_params_splitkv`` allocates when
  B*H*ceil(L/64) < 0.8 * 2 * SMs and S spans several key blocks (inference-sized calls).
- flash bwd (``mha_bwd`` via ``_flash_attention_backward``): dq, dk, dv = ``empty_like``;
  workspace: ``grad_out.contiguous()`` and ``out.contiguous()`` copies of the [B, L, H, Dv]
  views when they are not contiguous; softmax_d [B, H, r(L, 128)] fp32; dq_accum
  [B, r(L, 128), H, r(D, 32 if D <= 128 else 64)] fp32; with GQA dk_expanded and dv_expanded
  [B, S, H, D] in q's dtype (summed into dk, dv).
- efficient fwd (``_efficient_attention_forward``): out [B, L, H, Dv] seen as [B, H, L, Dv];
  logsumexp [B, H, r(L, 32)] fp32 (width 0 without grad, ``kAlignLSE = 32``); philox seed and
  offset [] int64 (host tensors on CUDA, counted here on the device: 16 bytes); workspace:
  output_accum [B, L, H, Dv] fp32 for fp16/bf16 with Dv > 128 (the kMaxK = 65536 kernel,
  ``kNeedsOutputAccumulatorBuffer``).
- efficient bwd (``_efficient_attention_backward``): grad_q/k/v [B, L, H, D] seen as
  [B, H, L, D]; grad_bias with its last dim padded to 16 then sliced; workspace:
  ``grad_out.contiguous()``, delta [B, H, L] fp32, and ``p.workspace_size()`` bytes: per (b, h)
  r(L, bi) * r(D, bj) fp32 for the grad_q accumulator, plus for fp16/bf16 with D > bi the
  grad_k/grad_v accumulators, ceil(S / bj) * bj * r(D, bi) fp32 each (bi, bj: Note 6).
  Not modelled: for fp32 the delta is built from a [B, L, H, Dv] fp32 product freed before
  the kernel runs.
- cuDNN fwd: out laid out like q (``alloc_with_matching_layout``); softmax stats [B, H, L, 1]
  fp32; seed and offset [] int64. bwd: dq, dk, dv = ``empty_like``; workspace: grad_out
  re-laid out like out when their strides differ (``permute_to_matching_layout``). Not
  modelled: cuDNN's own workspace, whose size the cuDNN plan decides at run time.
Autograd saves what ``derivatives.yaml`` names: query, key, value (as passed to the fused op,
so flash's padded copies), output, logsumexp, philox seed and offset, and attn_bias for
efficient and cuDNN.

Note 3 (the composite around the kernels, ``scaled_dot_product_attention`` in attention.cpp).
Flash: q, k, v padded to a multiple of 8 (``pad_last_dim<8>``), scale from the original head
dim, output sliced back. Efficient and cuDNN: a bool mask becomes an additive mask in q's dtype
(``convert_boolean_attn_mask``, ``-65504`` for cuDNN); efficient then pads it when a stride is
not a multiple of 8 (``preprocess_mask``: ``pad_bias<8>``) and expands it to [B, H, L, S].
Autocast casts SDPA's floating inputs to the autocast dtype first, on CUDA and CPU alike.

Note 4 (math). Math is not a kernel: ``_scaled_dot_product_attention_math`` is a composite of
aten ops (upcast of fp16/bf16 q, k, v to fp32 unless ``allowFP16BF16ReductionMathSDP``, causal
mask, ``repeat_interleave`` for GQA, matmul, ``_safe_softmax``, dropout, matmul, cast back),
the same code on CUDA and CPU, so the call runs it for real with the math backend forced.
One difference: with dropout, CUDA's ``at::dropout`` uses ``native_dropout`` (a bool mask)
where the CPU composite keeps a noise tensor in the activation dtype.

Note 5 (real values). The CPU implementations compute softmax(q k^T * scale + bias) v in fp32
with GQA groups repeated, and the backward from the same probabilities (dV = P^T dO,
dS = P * (dP - rowsum(dP * P)), dQ = dS K, dK = dS^T Q, both times scale). Dropout keeps an
element where ``rand >= p`` drawn from a generator seeded with the seed stored in the philox
tensors, so the backward redraws the forward's mask.

Note 6 (memory-efficient backward tiles). ``dispatch_cutlassB`` launches the first compiled
kernel that fits. We assume the one with the smallest kMaxK in {32, 64, 128, 65536} covering
max(D, Dv), kBlockSizeI bi = 128 when kMaxK > 64 (sm80+, or sm70+ in fp16/bf16) else 64,
kOutputInRF = fp16/bf16 and kMaxK <= bi, kBlockSizeJ bj = 128 when the kernel preloads (fp16/
bf16, sm80+, kOutputInRF, kMaxK > 64) else 64, and ``num_splits_key = ceil(S / bj)`` (no
``num_splits_key`` is passed from SDPA). GPUs with less shared memory per block (sm86, sm89)
may fall back to bi = 64; that changes the workspace by a rounding term.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import (register_flop_formula, sdpa_backward_flop_count,
                                      sdpa_flop_count)

from memfit.trace.cuda_sdpa_math import attention_backward_fp32, attention_fp32, seed_of
from memfit.trace.cuda_sdpa_select import BACKENDS, CudaBuild, SdpaInputs, select_backend

__all__ = ["CudaSdpaMode", "CudaBuild", "SdpaInputs", "select_backend"]

_HALF = (torch.float16, torch.bfloat16)
_F32 = torch.float32


def _round_up(x: int, m: int) -> int:
    """r(x, m) of Note 2: x rounded up to a multiple of m."""
    return (x + m - 1) // m * m


# -- buffers each backend allocates (Note 2) ------------------------------------------------------
def _alloc_with_matching_layout(q: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``alloc_with_matching_layout`` (sdp_utils.h): ``shape`` filled in q's stride order."""
    if tuple(q.shape) == tuple(shape):
        return torch.empty_like(q)
    order = sorted(range(q.dim()), key=lambda i: q.stride(i) or 2**63)
    strides, step = [0] * q.dim(), 1
    for i in order:
        strides[i], step = step, step * shape[i]
    return q.new_empty_strided(shape, strides)


def _fwd_buffers(q, k, v, backend, compute_lse):
    """(out, logsumexp, seed, offset, workspace) as the forward kernel allocates them."""
    b, h, lq, _ = q.shape
    dv = v.shape[-1]
    if backend == "flash":
        seed = q.new_empty((2,), dtype=torch.uint64)
        return (torch.empty_like(q), q.new_empty((b, h, lq), dtype=_F32), seed,
                q.new_empty((), dtype=torch.uint64), [])
    long0 = (q.new_empty((), dtype=torch.int64), q.new_empty((), dtype=torch.int64))
    if backend == "efficient":
        out = torch.empty_permuted((b, h, lq, dv), (0, 2, 1, 3), dtype=q.dtype, device=q.device)
        lse = q.new_empty((b, h, _round_up(lq, 32) if compute_lse else 0), dtype=_F32)
        accum = q.dtype in _HALF and dv > 128
        return (out, lse, *long0, [q.new_empty((b, lq, h, dv), dtype=_F32)] if accum else [])
    if backend == "cudnn":
        out = _alloc_with_matching_layout(q, (b, h, lq, dv))
        return out, q.new_empty((b, h, lq, 1), dtype=_F32), *long0, []
    raise ValueError(f"backend must be one of flash, efficient, cudnn; got {backend!r}")


def _mem_eff_bwd_workspace_bytes(q, k, v, sm_major: int) -> int:
    """``p.workspace_size()`` of the cutlassB kernel assumed in Note 6."""
    b, h, lq, d = q.shape
    s, dv = k.shape[2], v.shape[-1]
    half = q.dtype in _HALF
    max_k = next(m for m in (32, 64, 128, 2**16) if m >= max(d, dv))
    bi = 128 if max_k > 64 and (sm_major >= 8 or (sm_major >= 7 and half)) else 64
    in_rf = half and max_k <= bi
    bj = 128 if half and sm_major >= 8 and in_rf and max_k > 64 else 64
    elems = _round_up(lq, bi) * _round_up(d, bj)
    if half and not in_rf:
        elems += math.ceil(s / bj) * bj * (_round_up(d, bi) + _round_up(dv, bi))
    return b * h * _round_up(elems, 4) * 4


def _bwd_buffers(grad_out, q, k, v, bias, out, backend, bias_grad, sm_major):
    """(grad_q, grad_k, grad_v, grad_bias or an empty tensor, workspace) of the backward."""
    b, h, lq, d = q.shape
    s, dv = k.shape[2], v.shape[-1]
    ws = []
    if backend in ("flash", "efficient") and not grad_out.transpose(1, 2).is_contiguous():
        ws.append(grad_out.new_empty((b, lq, h, dv)))
    if backend == "flash":
        if not out.transpose(1, 2).is_contiguous():
            ws.append(out.new_empty((b, lq, h, dv)))
        lq_r, d_r = _round_up(lq, 128), _round_up(d, 32 if d <= 128 else 64)
        ws += [q.new_empty((b, h, lq_r), dtype=_F32),                  # softmax_d
               q.new_empty((b, lq_r, h, d_r), dtype=_F32)]             # dq_accum
        if k.shape[1] != h:
            ws += [q.new_empty((b, s, h, d)), q.new_empty((b, s, h, dv))]
    grads = [torch.empty_like(t) for t in (q, k, v)]
    grad_bias = q.new_empty((0,))
    if backend == "efficient":
        grads = [torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device)
                 for t in (q, k, v)]
        ws.append(q.new_empty((b, h, lq), dtype=_F32))                  # delta
        nbytes = _mem_eff_bwd_workspace_bytes(q, k, v, sm_major)
        ws += [q.new_empty((nbytes,), dtype=torch.uint8)] if nbytes else []
        if bias_grad:
            last = bias.shape[-1]
            grad_bias = bias.new_empty((*bias.shape[:-1], _round_up(last, 16)))[..., :last]
    if backend == "cudnn" and not _same_strides(grad_out, out):
        ws.append(_alloc_with_matching_layout(out, tuple(grad_out.shape)))
    return (*grads, grad_bias, ws)


def _same_strides(a: Tensor, b: Tensor) -> bool:
    """``same_strides`` (sdp_utils.h): strides equal over the dims of size > 1."""
    keep = lambda t: [st for st, sz in zip(t.stride(), t.shape) if sz > 1]   # noqa: E731
    return keep(a) == keep(b)


# -- the custom ops (Note 1) ----------------------------------------------------------------------
@torch.library.custom_op("memfit::sdpa_fwd", mutates_args=())
def sdpa_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, backend: str,
             dropout_p: float, is_causal: bool, scale: float, compute_lse: bool,
             sm_major: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    out, lse, seed, offset, ws = _fwd_buffers(q, k, v, backend, compute_lse)
    seed.view(torch.int64).zero_()
    offset.view(torch.int64).zero_()
    if dropout_p > 0:
        seed.view(torch.int64).view(-1)[0] = int(torch.randint(0, 2**62, ()))
    o, row_lse, _ = attention_fp32(q, k, v, bias, is_causal, scale, dropout_p, seed_of(seed))
    out.copy_(o)
    lse_rows = lse[..., 0] if lse.dim() == 4 else lse[..., : q.shape[2]]
    lse_rows.copy_(row_lse[..., : lse_rows.shape[-1]])
    return out, lse, seed, offset, ws


@sdpa_fwd.register_fake
def _(q, k, v, bias, backend, dropout_p, is_causal, scale, compute_lse, sm_major):
    return _fwd_buffers(q, k, v, backend, compute_lse)


@torch.library.custom_op("memfit::sdpa_bwd", mutates_args=())
def sdpa_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
             out: Tensor, lse: Tensor, seed: Tensor, offset: Tensor, backend: str,
             dropout_p: float, is_causal: bool, scale: float, bias_grad: bool,
             sm_major: int) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    gq, gk, gv, gbias, ws = _bwd_buffers(grad_out, q, k, v, bias, out, backend, bias_grad,
                                         sm_major)
    dq, dk, dv, ds = attention_backward_fp32(grad_out, q, k, v, bias, is_causal, scale,
                                             dropout_p, seed_of(seed))
    for buf, val in ((gq, dq), (gk, dk), (gv, dv)):
        buf.copy_(val)
    if bias_grad:
        gbias.copy_(ds)
    return gq, gk, gv, gbias, ws


@sdpa_bwd.register_fake
def _(grad_out, q, k, v, bias, out, lse, seed, offset, backend, dropout_p, is_causal, scale,
      bias_grad, sm_major):
    return _bwd_buffers(grad_out, q, k, v, bias, out, backend, bias_grad, sm_major)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, backend, dropout_p, is_causal, scale, _, sm_major = inputs
    out, lse, seed, offset, ws = output
    ctx.save_for_backward(q, k, v, bias, out, lse, seed, offset)     # derivatives.yaml
    ctx.mark_non_differentiable(lse, seed, offset, *ws)
    ctx.args = (backend, dropout_p, is_causal, scale, sm_major)


def _backward(ctx, grad_out, *_unused):
    q, k, v, bias, out, lse, seed, offset = ctx.saved_tensors
    bias_grad = bool(ctx.needs_input_grad[3])
    gq, gk, gv, gbias, ws = torch.ops.memfit.sdpa_bwd(
        grad_out, q, k, v, bias, out, lse, seed, offset, *ctx.args[:4], bias_grad, ctx.args[4])
    del ws                                          # workspace dies inside the op (Note 1)
    return gq, gk, gv, gbias if bias_grad else None, None, None, None, None, None, None


torch.library.register_autograd("memfit::sdpa_fwd", _backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.memfit.sdpa_fwd)
def _fwd_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.memfit.sdpa_bwd)
def _bwd_flops(grad_out_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kw) -> int:
    return sdpa_backward_flop_count(grad_out_shape, q_shape, k_shape, v_shape)


# -- the composite around the kernels (Note 3) ----------------------------------------------------
def _bind(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False) -> dict:
    """The arguments of ``F.scaled_dot_product_attention``, by name."""
    return dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _valid(c: dict) -> bool:
    """``validate_sdpa_input``; a call it would refuse is left to PyTorch to refuse."""
    q, k, v, m = c["query"], c["key"], c["value"], c["attn_mask"]
    ok = q.dtype == k.dtype == v.dtype and min(q.dim(), k.dim(), v.dim()) >= 2
    return ok and (m is None or m.dtype in (torch.bool, q.dtype))


def _autocast(c: dict) -> dict:
    """Autocast's cast of SDPA's floating inputs (``lower_precision_fp`` on CUDA and CPU)."""
    dev = c["query"].device.type
    if not torch.is_autocast_enabled(dev):
        return c
    dtype = torch.get_autocast_dtype(dev)

    def cast(t):        # autocast's is_eligible: floating point, not double
        eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible else t

    return {**c, **{n: cast(c[n]) for n in ("query", "key", "value", "attn_mask")}}


def _enabled() -> frozenset[str]:
    """The backends the runtime flags (``sdpa_kernel``, ``torch.backends.cuda``) allow."""
    cuda = torch.backends.cuda
    flags = {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled(),
             "cudnn": cuda.cudnn_sdp_enabled(), "math": cuda.math_sdp_enabled()}
    return frozenset(b for b in BACKENDS if flags[b])


def _pad_last_dim(t: Tensor, alignment: int) -> Tensor:
    """``pad_last_dim<alignment, false>``."""
    rest = t.shape[-1] % alignment
    return t if rest == 0 else F.pad(t, (0, alignment - rest))


def _convert_boolean_attn_mask(mask: Tensor | None, dtype, neg: float) -> Tensor | None:
    """``convert_boolean_attn_mask`` (``neg = -inf``) and its cuDNN twin (``neg = -65504``)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(neg, dtype=dtype, device=mask.device))


def _preprocess_mask(mask: Tensor, q: Tensor, k: Tensor) -> Tensor:
    """``preprocess_mask``: ``pad_bias<8>`` unless every stride but the last is a multiple
    of 8 and the last is 1, then expand to [B, H, L, S]."""
    aligned = mask.stride(-1) == 1 and all(st % 8 == 0 for st in mask.stride()[:-1])
    if not aligned:
        last = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _run_fused(backend: str, c: dict, sm_major: int) -> Tensor:
    q, k, v, mask = c["query"], c["key"], c["value"], c["attn_mask"]
    head_dim = q.shape[-1]
    scale = c["scale"] if c["scale"] is not None else 1.0 / math.sqrt(head_dim)
    bias = None
    if backend == "flash":
        q, k, v = (_pad_last_dim(t, 8) for t in (q, k, v))
    elif mask is not None:
        bias = _convert_boolean_attn_mask(mask, q.dtype, -65504.0 if backend == "cudnn"
                                          else float("-inf"))
        if backend == "efficient":
            bias = _preprocess_mask(bias, q, k)
    compute_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    out, *_, ws = torch.ops.memfit.sdpa_fwd(q, k, v, bias, backend, float(c["dropout_p"]),
                                            bool(c["is_causal"]), float(scale), compute_lse,
                                            sm_major)
    del ws                                          # workspace dies inside the op (Note 1)
    return out if out.shape[-1] == head_dim else out[..., :head_dim]


# -- the mode -------------------------------------------------------------------------------------
class CudaSdpaMode(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs as CUDA GPU ``compute_capability``
    would run it; ``calls`` records the backend of each call, in order."""

    def __init__(self, compute_capability: tuple[int, int], build: CudaBuild = CudaBuild()):
        super().__init__()
        self.compute_capability = tuple(compute_capability)
        self.build = build
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = _bind(*args, **kwargs)
        if not _valid(call):
            return func(*args, **kwargs)               # let PyTorch raise its own error
        call = _autocast(call)
        inputs = SdpaInputs.from_tensors(call["query"], call["key"], call["value"],
                                         call["attn_mask"], call["dropout_p"],
                                         call["is_causal"], call["enable_gqa"])
        backend = select_backend(inputs, self.compute_capability, self.build, _enabled())
        self.calls.append(backend)
        if backend == "math":
            with sdpa_kernel(SDPBackend.MATH):
                return func(*args, **kwargs)
        return _run_fused(backend, call, self.compute_capability[0])
