"""Which kernel ``F.scaled_dot_product_attention`` runs on a CUDA GPU, decided on the CPU.

Each ``_check_*`` function below copies one filter of the same name in PyTorch 2.13's
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (or ``sdp_utils_cpp.h``); the
``_can_use_*`` functions copy ``can_use_flash_attention``, ``can_use_mem_efficient_attention``
and ``can_use_cudnn_attention``; ``select_backend`` copies ``select_sdp_backend``. Only the
dense (non-nested), CUDA (not ROCm) branches are copied.

Note 1 (priority order). The default order is flash, efficient, math, cuDNN
(``at::globalContext().sDPPriorityOrder()``, printed by ``torch._C._get_sdp_priority_order()``
as ``[1, 2, 0, 3, 4]``). ``check_prefer_cudnn_attention`` moves cuDNN first on sm90 and
sm10x when the runtime cuDNN is newer than 9.15.0 (with CUDA < 13 only for minor 0 or 3),
unless ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set. The wheels of torch >= 2.11 bundle such a
cuDNN, so on an H100 cuDNN attention is the default; ``CudaBuild`` says which build we model.

Note 2 (grouped-query attention). With ``enable_gqa=True`` and fewer key/value heads than
query heads, flash and cuDNN accept the call (``check_batch_size_and_num_heads_dense`` with
``supports_gqa=true``) and handle the groups inside the kernel; memory-efficient attention
instantiates it with ``supports_gqa=false`` in 2.13 (native GQA came later, pytorch#191085),
so such a call falls through to math, which repeats key and value
(``pre_process_group_query_attention_input``: ``repeat_interleave`` over the head dim).

Note 3 (what is not modelled). ``sdpa_kernel(..., set_priority=True)``, the deterministic
mode (cuDNN is refused under ``torch.use_deterministic_algorithms(True)``), FA3/fp8,
nested tensors, and the environment variables read by ``sdp_utils.cpp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["BACKENDS", "CudaBuild", "SdpaInputs", "select_backend"]

BACKENDS = ("flash", "efficient", "cudnn", "math")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaBuild:
    """The CUDA build of torch being modelled (Note 1)."""

    cudnn_version: int = 91900   # runtime cuDNN as cudnnGetVersion() reports it: 9.19.0
    cuda_major: int = 13         # CUDA major version the wheel was built with (cu130)


@dataclass(frozen=True)
class SdpaInputs:
    """What ``select_sdp_backend`` looks at, taken from one SDPA call's arguments.

    Shapes are ``[batch, heads, seq_len, head_dim]``; strides and storage offsets are in
    elements.
    """

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]       # query, key, value
    mask_shape: tuple[int, ...] | None = None                  # None: no attn_mask
    mask_dtype: torch.dtype | None = None
    mask_requires_grad: bool = False
    mask_last_stride: int = 1
    is_causal: bool = False
    dropout_p: float = 0.0
    enable_gqa: bool = False
    requires_grad: bool = False     # any of q, k, v requires grad and grad mode is on
    last_strides: tuple[int, int, int] = (1, 1, 1)
    storage_offsets: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def from_tensors(cls, query, key, value, attn_mask=None, dropout_p: float = 0.0,
                     is_causal: bool = False, enable_gqa: bool = False) -> "SdpaInputs":
        qkv = (query, key, value)
        has_mask = attn_mask is not None
        return cls(
            q_shape=tuple(query.shape), k_shape=tuple(key.shape), v_shape=tuple(value.shape),
            dtypes=tuple(t.dtype for t in qkv),
            mask_shape=tuple(attn_mask.shape) if has_mask else None,
            mask_dtype=attn_mask.dtype if has_mask else None,
            mask_requires_grad=has_mask and attn_mask.requires_grad,
            mask_last_stride=attn_mask.stride(-1) if has_mask and attn_mask.dim() else 1,
            is_causal=is_causal, dropout_p=float(dropout_p), enable_gqa=enable_gqa,
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in qkv),
            last_strides=tuple(t.stride(-1) if t.dim() else 1 for t in qkv),
            storage_offsets=tuple(t.storage_offset() for t in qkv),
        )

    @property
    def has_mask(self) -> bool:
        return self.mask_shape is not None

    @property
    def head_dims(self) -> tuple[int, int, int]:
        return self.q_shape[-1], self.k_shape[-1], self.v_shape[-1]


def select_backend(inputs: SdpaInputs, compute_capability: tuple[int, int],
                   build: CudaBuild = CudaBuild(),
                   enabled: frozenset[str] = frozenset(BACKENDS)) -> str:
    """The backend ``select_sdp_backend`` picks: "flash", "efficient", "cudnn" or "math".

    ``enabled`` are the backends the runtime flags allow (``torch.backends.cuda.*_sdp_enabled``).
    """
    if len(compute_capability) != 2:
        raise ValueError(f"compute_capability must be (major, minor), got {compute_capability}")
    compute_capability = tuple(compute_capability)
    order = ["flash", "efficient", "math", "cudnn"]
    if _check_prefer_cudnn_attention(compute_capability, build):
        order = ["cudnn", "flash", "efficient", "math"]
    can_use = {"flash": _can_use_flash_attention, "efficient": _can_use_mem_efficient_attention,
               "cudnn": _can_use_cudnn_attention, "math": lambda *_: True}
    for backend in order:
        if backend in enabled and can_use[backend](inputs, compute_capability, build):
            return backend
    raise ValueError(
        f"no SDPA backend can run {inputs} on sm{compute_capability[0]}{compute_capability[1]} "
        f"with only {sorted(enabled)} enabled (PyTorch: 'No available kernel'); enable math")


# -- the three fused backends -------------------------------------------------------------------
def _can_use_flash_attention(p: SdpaInputs, sm, build) -> bool:
    """``can_use_flash_attention``: general constraints, then the dense ones."""
    return (_check_tensor_shapes(p) and _check_for_attn_mask(p)
            and _check_head_dim_size_flash(p) and _check_flash_attention_hardware_support(sm)
            and _check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120(p, sm)
            and _check_flash_causal_non_square_seqlens(p) and _check_dtypes_low_precision(p, sm)
            and _check_batch_size_and_num_heads_dense(p, supports_gqa=True)
            and _check_nonzero_sequence_lengths_dense(p)
            and _check_last_dim_stride_equals_1_dense(p, ignore_singleton_dim=True))


def _can_use_mem_efficient_attention(p: SdpaInputs, sm, build) -> bool:
    """``can_use_mem_efficient_attention`` (CUDA branch)."""
    allowed = (torch.float16, torch.float32) + ((torch.bfloat16,) if sm[0] >= 8 else ())
    return (_check_mem_efficient_hardware_support(sm) and _check_tensor_shapes(p)
            and _check_head_dim_size_mem_efficient(p, sm)
            and _check_data_ptr_alignment_mem_efficient(p, sm)
            and _check_nonzero_sequence_lengths_dense(p)
            and _check_last_dim_stride_equals_1_dense(p, ignore_singleton_dim=False)
            and _check_batch_size_and_num_heads_dense(p, supports_gqa=False)   # Note 2
            and _check_tensor_dtype(p, allowed))


def _can_use_cudnn_attention(p: SdpaInputs, sm, build) -> bool:
    """``can_use_cudnn_attention``: cuDNN >= 9, no dropout on 9.11-9.13, then the filters."""
    v = build.cudnn_version
    if v < 90000 or (p.dropout_p > 0 and 91100 < v < 91400):
        return False
    return (_check_tensor_shapes(p) and _check_dtypes_low_precision(p, sm)
            and _check_attn_mask_shape(p) and _check_cudnn_hardware_support(sm)
            and _check_cudnn_dropout(p) and _check_nonzero_sequence_lengths_dense(p)
            and _check_last_dim_stride_equals_1_dense(p, ignore_singleton_dim=True)
            and _check_batch_size_and_num_heads_dense(p, supports_gqa=True,
                                                      requires_same_num_heads=False)
            and _check_cudnn_tensor_shapes(p, sm, build)
            and _check_cudnn_d256_bprop_head_dim(p, sm, build))


# -- filters, each named after the C++ function it copies -----------------------------------------
def _check_prefer_cudnn_attention(sm, build: CudaBuild) -> bool:
    """``check_prefer_cudnn_attention`` (sdp_utils.cpp), Note 1."""
    major, minor = sm
    minor_ok = build.cuda_major >= 13 or minor in (0, 3)
    return build.cudnn_version > 91500 and major in (9, 10) and minor_ok


def _check_sm_version(sm, lower: tuple[int, int], upper: tuple[int, int]) -> bool:
    """``check_sm_version<lower, upper>``: lower <= sm <= upper, both inclusive."""
    return lower <= tuple(sm) <= upper


def _check_flash_attention_hardware_support(sm) -> bool:
    """``check_flash_attention_hardware_support``: sm80 to sm121."""
    return _check_sm_version(sm, (8, 0), (12, 1))


def _check_mem_efficient_hardware_support(sm) -> bool:
    """``check_mem_efficient_hardware_support``: sm50 to sm121."""
    return _check_sm_version(sm, (5, 0), (12, 1))


def _check_cudnn_hardware_support(sm) -> bool:
    """``check_cudnn_hardware_support``: sm80 to sm121."""
    return _check_sm_version(sm, (8, 0), (12, 1))


def _check_tensor_shapes(p: SdpaInputs) -> bool:
    """``check_tensor_shapes`` (sdp_utils_cpp.h): q, k and v are all 4-D."""
    return len(p.q_shape) == len(p.k_shape) == len(p.v_shape) == 4


def _check_for_attn_mask(p: SdpaInputs) -> bool:
    """``check_for_attn_mask``: flash takes no attn_mask (``is_causal`` is not a mask)."""
    return not p.has_mask


def _check_tensor_dtype(p: SdpaInputs, allowed) -> bool:
    """``check_tensor_dtype``: q, k, v share one dtype, and it is allowed."""
    return len(set(p.dtypes)) == 1 and p.dtypes[0] in allowed


def _check_dtypes_low_precision(p: SdpaInputs, sm) -> bool:
    """``check_dtypes_low_precision`` (also what ``check_dtypes_flash_attention`` uses
    without FA3): fp16/bf16 on sm80+, fp16 below."""
    return _check_tensor_dtype(p, _HALF if sm[0] >= 8 else (torch.float16,))


def _check_head_dim_size_flash(p: SdpaInputs) -> bool:
    """``check_head_dim_size_flash``: equal head dims, at most 256 (the composite pads them
    to a multiple of 8 before the kernel)."""
    dq, dk, dv = p.head_dims
    return dq == dk == dv and dq <= 256


def _minimum_gemm_alignment(p: SdpaInputs, sm) -> int:
    """``minimum_gemm_alignment``: 4 on sm80+, raised to 128 bits when tensor cores are used
    (sm80+, or sm7x in fp16/bf16)."""
    is_half = p.dtypes[0] in _HALF
    use_tc = sm[0] >= 8 or (sm[0] >= 7 and is_half)
    alignment = 4 if sm[0] >= 8 else 1
    if use_tc:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def _check_head_dim_size_mem_efficient(p: SdpaInputs, sm) -> bool:
    """``check_head_dim_size_mem_efficient``: q and k head dims equal; q and v head dims
    positive multiples of the gemm alignment. No upper bound on CUDA."""
    dq, dk, dv = p.head_dims
    a = _minimum_gemm_alignment(p, sm)
    return dq == dk and dq > 0 and dv > 0 and dq % a == 0 and dv % a == 0


def _check_data_ptr_alignment_mem_efficient(p: SdpaInputs, sm) -> bool:
    """``check_data_ptr_alignment_mem_efficient``: on sm80+, storage offsets aligned to the
    gemm alignment (the allocator's base pointers are 256-byte aligned)."""
    if sm[0] < 8:
        return True
    a = _minimum_gemm_alignment(p, sm)
    return all(off % a == 0 for off in p.storage_offsets)


def _check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120(p, sm) -> bool:
    """Same-named check: training on sm86-89 or sm120-121 needs head_dim <= 192, or > 224
    without dropout."""
    consumer = _check_sm_version(sm, (8, 6), (8, 9)) or _check_sm_version(sm, (12, 0), (12, 1))
    if not (p.requires_grad and consumer):
        return True
    d = p.head_dims[0]
    return d <= 192 or (p.dropout_p == 0 and d > 224)


def _check_flash_causal_non_square_seqlens(p: SdpaInputs) -> bool:
    """``check_flash_causal_non_square_seqlens``: causal needs seqlen_q == seqlen_k."""
    return not p.is_causal or p.q_shape[-2] == p.k_shape[-2]


def _check_batch_size_and_num_heads_dense(p: SdpaInputs, supports_gqa: bool,
                                          requires_same_num_heads: bool = True) -> bool:
    """``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``, with
    ``check_grouped_query_attention`` for the GQA case (Note 2)."""
    (bq, hq), (bk, hk), (bv, hv) = p.q_shape[:2], p.k_shape[:2], p.v_shape[:2]
    if not bq == bk == bv:
        return False
    if p.enable_gqa and supports_gqa:
        if requires_same_num_heads and hk != hv:
            return False
        return hq % hk == 0 and (requires_same_num_heads or hq % hv == 0)
    return hq == hk == hv


def _check_nonzero_sequence_lengths_dense(p: SdpaInputs) -> bool:
    """``check_nonzero_sequence_lengths_dense``."""
    return p.q_shape[-2] != 0 and p.k_shape[-2] != 0


def _check_last_dim_stride_equals_1_dense(p: SdpaInputs, ignore_singleton_dim: bool) -> bool:
    """``check_last_dim_stride_equals_1_dense``: q, k, v and (on GPU) the mask have a
    contiguous last dim; with ``ignore_singleton_dim`` a head dim of 1 passes."""
    ok = all(s == 1 for s in p.last_strides)
    if ignore_singleton_dim:
        ok = ok or p.q_shape[-1] == 1
    return ok and (not p.has_mask or p.mask_last_stride == 1)


def _check_attn_mask_shape(p: SdpaInputs) -> bool:
    """``check_attn_mask_shape``: a mask that needs no grad, 2-D or 4-D, each dim equal to
    the attention's or 1."""
    if not p.has_mask:
        return True
    if p.mask_requires_grad:
        return False
    m = p.mask_shape
    fits = lambda size, target: size in (target, 1)   # noqa: E731
    if len(m) < 2 or not (fits(m[-2], p.q_shape[2]) and fits(m[-1], p.k_shape[2])):
        return False
    if len(m) == 2:
        return True
    return len(m) == 4 and fits(m[0], p.q_shape[0]) and fits(m[1], p.q_shape[1])


def _check_cudnn_dropout(p: SdpaInputs) -> bool:
    """``check_cudnn_dropout``: dropout probability a multiple of 1/16."""
    return p.dropout_p * 16 == math.floor(p.dropout_p * 16)


def _cudnn_supports_d256(sm, build: CudaBuild) -> bool:
    """The ``supports_d256`` condition shared by the two cuDNN head-dim checks (assumes the
    bundled cudnn-frontend is >= 1.24, ``kCuDNNFrontendSupportsD256``)."""
    sm90_or_10x = sm == (9, 0) or sm[0] == 10
    unsupported_sm107 = tuple(sm) == (10, 7) and build.cudnn_version <= 92500
    return sm90_or_10x and not unsupported_sm107 and build.cudnn_version > 92200


def _check_cudnn_tensor_shapes(p: SdpaInputs, sm, build: CudaBuild) -> bool:
    """``check_cudnn_tensor_shapes`` (cuDNN >= 9 branch): batch and heads <= 65535, head dims
    multiples of 8 up to 128 (256 or 192/128 on sm90/sm10x with newer cuDNN), s_kv != 1,
    no s_q == 1 with dropout."""
    (b, h, s_q, d_qk), s_k, d_v = p.q_shape, p.k_shape[2], p.v_shape[3]
    if b > 65535 or h > 65535:
        return False
    sm90_or_10x = sm == (9, 0) or sm[0] == 10
    limit = 128
    if _cudnn_supports_d256(sm, build):
        limit = 256
    elif sm90_or_10x and build.cudnn_version >= 91100 and (d_qk, d_v) == (192, 128):
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    return s_k != 1 and not (p.dropout_p != 0 and s_q == 1)


def _check_cudnn_d256_bprop_head_dim(p: SdpaInputs, sm, build: CudaBuild) -> bool:
    """``check_cudnn_d256_bprop_head_dim``: where d256 is supported, training allows only
    (<=128, <=128), (192, 128) and (256, 256) head dims."""
    if not p.requires_grad or not _cudnn_supports_d256(sm, build):
        return True
    d_qk, d_v = p.q_shape[3], p.v_shape[3]
    return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
