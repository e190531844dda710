"""flash-attn 2 (``attn_implementation="flash_attention_2"``) modelled on the CPU: the padded,
packed (varlen) and dense calls transformers makes, with the kernels' outputs, saved tensors and
workspaces.

Note 1 (what transformers calls). transformers 5's ``integrations/flash_attention.py``
(``flash_attention_forward``) transposes q, k, v to [B, L, H, D], pads v's head dim up to q's,
casts fp32 inputs back to the autocast or the weights' dtype (``get_target_dtype``, asked
here about CUDA's autocast: the trace's fakes are CPU tensors; ``fa_peft_integration_check``); ``modeling_flash_attention_utils._flash_attention_forward`` then
takes one of four paths:
  (a) an attention mask (padding): ``_upad_input`` gathers the real tokens of q, k, v
      (``_index_first_axis``), ``flash_attn_varlen_func`` runs over them, and ``pad_input``
      scatters the output into zeros of [B, L, H, D] (transformers' ``_pad_input`` here: the same
      ops as flash-attn's ``IndexPutFirstAxis``, which saves only the indices);
  (b) ``cu_seq_lens_q/k`` and ``max_length_q/k`` given (``DataCollatorWithFlattening(
      return_flash_attn_kwargs=True)``): q, k, v reshaped to [B L, H, D], varlen;
  (c) packed ``position_ids`` (``_is_packed_sequence``: batch 1, positions not one increasing
      run): ``_prepare_from_posids`` makes q, k, v contiguous [T, H, D] and, in every layer,
      int32 ``cu_seqlens`` where the positions restart; varlen;
  (d) otherwise ``flash_attn_func`` on [B, L, H, D].
``flash_attention_forward`` below takes the same steps with transformers' own helpers; only the
two flash-attn calls are memfit's (Note 3).

Note 2 (what flash-attn allocates). Source: Dao-AILab/flash-attention v2.8.3 (and main at
0251105, 2.8.4, unchanged there), ``flash_attn/flash_attn_interface.py`` and
``csrc/flash_attn/flash_api.cpp``; the layouts below hold since v2.6.0, which made the varlen
logsumexp unpadded. B batch (varlen: sequences, ``cu_seqlens.numel() - 1``), T tokens, H and Hk
query and key/value heads, D the head dim padded to a multiple of 8, Dr = r(D, 32) for D <= 128
else r(D, 64), r(x, m) = x rounded up to a multiple of m.
- Python (``FlashAttnVarlenFunc``, ``FlashAttnFunc``): q, k, v padded to a multiple of 8 in the
  head dim (copies, only when needed); autograd saves q, k, v as padded, out_padded,
  softmax_lse, cu_seqlens_q and cu_seqlens_k (varlen) and rng_state; the output is sliced back.
  Backward: dq, dk, dv = ``empty_like`` of the padded q, k, v, dout padded, results sliced.
- varlen forward (``mha_varlen_fwd``): out = ``empty_like(q)`` [T, H, D]; softmax_lse [H, T]
  fp32; rng_state [2] int64.
- dense forward (``mha_fwd``): out [B, L, H, D]; softmax_lse [B, H, L] fp32; rng_state [2]
  int64. Not modelled: the split-KV accumulators ``set_params_splitkv`` makes when
  B H ceil(L/64) < 0.8 * 2 * SMs ([splits, B, H, L] and [splits, B, H, L, Dr] fp32, freed at the
  call's end): the card's SM count is not in memfit's GPU table, and a training step's calls are
  above that line unless small.
- varlen backward (``mha_varlen_bwd``): softmax_d [H, T + 128 B] fp32; dq_accum
  [T + 128 B, H, Dr] fp32 (128 rows of slack per sequence); with Hk < H, dk_expanded and
  dv_expanded [T, H, D] in q's dtype, summed into dk, dv. Freed at the call's end.
- dense backward (``mha_bwd``): softmax_d [B, H, r(L, 128)] fp32; dq_accum [B, r(L, 128), H, Dr]
  fp32; with Hk < H, [B, S, H, D] twice.
Not modelled: the deterministic backward (``FLASH_ATTENTION_DETERMINISTIC=1``: dq_accum in
ceil(SMs / (B H)) zeroed splits); copies ``maybe_contiguous`` makes of an input whose last dim is
strided (transformers never passes one). Sliding windows and softcapping change no buffer.

Note 3 (how it runs in a trace). The two kernels are custom ops, ``memfit::flash_attn_fwd`` and
``memfit::flash_attn_bwd``, as ``cuda_sdpa`` models SDPA's: the fake allocates what the kernel
allocates, the CPU implementation computes the true values in fp32 (each sequence attending to
itself only), and the backward's workspace is returned and dropped at once. transformers looks
its attention function up in ``AttentionInterface`` at each call; while a ``FlashAttn`` context is
open, "flash_attention_2" maps to ``flash_attention_forward`` below (``AttentionInterface.
register``, transformers' own extension point) and back to transformers' function when the last
context closes. The mapping is process-wide, so autograd's backward thread and a checkpoint's
recompute see it too; contexts nest, and the innermost GPU answers.

Note 4 (what is refused). flash-attn 2 needs an sm80+ GPU, fp16 or bf16 inputs and a head dim of
at most 256 (``mha_fwd``'s checks): such a call raises ``ValueError`` naming the fix, as the real
run would fail.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor

from memfit.trace.cuda_sdpa_math import attention_backward_fp32, attention_fp32, seed_of

__all__ = ["FlashAttn", "flash_attention_forward", "is_open", "IMPLEMENTATION"]

IMPLEMENTATION = "flash_attention_2"
_HALF = (torch.float16, torch.bfloat16)
_F32 = torch.float32
_lock = threading.Lock()
_stack: list["FlashAttn"] = []       # open contexts, innermost last (Note 3)
_original = None                     # transformers' own function while ours is registered


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _head_rounded(d: int) -> int:
    """Dr of Note 2."""
    return _round_up(d, 32 if d <= 128 else 64)


# -- buffers (Note 2) -----------------------------------------------------------------------------
def _fwd_buffers(q: Tensor, cu_seqlens_q: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(out, softmax_lse, rng_state) as ``mha_varlen_fwd`` / ``mha_fwd`` allocate them."""
    if cu_seqlens_q is not None:                       # q: [T, H, D]
        t, h, _ = q.shape
        lse = q.new_empty((h, t), dtype=_F32)
    else:                                              # q: [B, L, H, D]
        b, l, h, _ = q.shape
        lse = q.new_empty((b, h, l), dtype=_F32)
    return torch.empty_like(q), lse, q.new_empty((2,), dtype=torch.int64)


def _bwd_buffers(q, k, v, cu_seqlens_q) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, workspace) of the backward."""
    grads = [torch.empty_like(t) for t in (q, k, v)]
    h, d = q.shape[-2], q.shape[-1]
    hk = k.shape[-2]
    if cu_seqlens_q is not None:
        rows = q.shape[0] + 128 * (cu_seqlens_q.numel() - 1)
        ws = [q.new_empty((h, rows), dtype=_F32),                        # softmax_d
              q.new_empty((rows, h, _head_rounded(d)), dtype=_F32)]      # dq_accum
        expanded = (k.shape[0], h, d)
    else:
        b, l = q.shape[:2]
        lr = _round_up(l, 128)
        ws = [q.new_empty((b, h, lr), dtype=_F32),
              q.new_empty((b, lr, h, _head_rounded(d)), dtype=_F32)]
        expanded = (b, k.shape[1], h, d)
    if hk != h:
        ws += [q.new_empty(expanded), q.new_empty(expanded)]             # dk/dv_expanded
    return (*grads, ws)


# -- true values on CPU tensors (Note 3) ----------------------------------------------------------
def _bias(lq: int, lk: int, cu_q, cu_k, causal: bool, window: tuple[int, int], device) -> Tensor:
    """An additive [1, 1, Lq, Lk] fp32 mask: each sequence sees itself only, causal aligned to
    its bottom right, within the window (-1: unbounded)."""
    keep = torch.zeros((lq, lk), dtype=torch.bool, device=device)
    starts = zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]) \
        if cu_q is not None else [(0, lq, 0, lk)]
    for q0, q1, k0, k1 in starts:
        i = torch.arange(q1 - q0, device=device)[:, None] + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0, device=device)[None, :]
        ok = torch.ones((q1 - q0, k1 - k0), dtype=torch.bool, device=device)
        left, right = window
        if causal:
            right = 0
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
        keep[q0:q1, k0:k1] = ok
    zero = torch.zeros((), dtype=_F32, device=device)
    return torch.where(keep, zero, float("-inf"))[None, None]


def _as_bhld(t: Tensor, varlen: bool) -> Tensor:
    return t.transpose(0, 1)[None] if varlen else t.transpose(1, 2)


def _from_bhld(t: Tensor, varlen: bool) -> Tensor:
    return t[0].transpose(0, 1) if varlen else t.transpose(1, 2)


# -- the custom ops (Note 3) ----------------------------------------------------------------------
@torch.library.custom_op("memfit::flash_attn_fwd", mutates_args=())
def flash_attn_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None,
                   cu_seqlens_k: Tensor | None, dropout_p: float, scale: float, causal: bool,
                   window_left: int, window_right: int, softcap: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    out, lse, rng = _fwd_buffers(q, cu_seqlens_q)
    if softcap > 0:
        raise NotImplementedError("memfit computes no softcapped attention values on the CPU")
    rng.zero_()
    if dropout_p > 0:
        rng[0] = int(torch.randint(0, 2**62, ()))
    varlen = cu_seqlens_q is not None
    bias = _bias(q.shape[-3], k.shape[-3], cu_seqlens_q, cu_seqlens_k, causal,
                 (window_left, window_right), q.device)
    o, row_lse, _ = attention_fp32(*(_as_bhld(t, varlen) for t in (q, k, v)), bias, False,
                                   scale, dropout_p, seed_of(rng))
    out.copy_(_from_bhld(o, varlen))
    lse.copy_(row_lse[0] if varlen else row_lse)
    return out, lse, rng


@flash_attn_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, scale, causal, window_left, window_right,
      softcap):
    return _fwd_buffers(q, cu_seqlens_q)


@torch.library.custom_op("memfit::flash_attn_bwd", mutates_args=())
def flash_attn_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor | None,
                   cu_seqlens_k: Tensor | None, rng: Tensor, dropout_p: float, scale: float,
                   causal: bool, window_left: int, window_right: int
                   ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    dq, dk, dv, ws = _bwd_buffers(q, k, v, cu_seqlens_q)
    varlen = cu_seqlens_q is not None
    bias = _bias(q.shape[-3], k.shape[-3], cu_seqlens_q, cu_seqlens_k, causal,
                 (window_left, window_right), q.device)
    grads = attention_backward_fp32(*(_as_bhld(t, varlen) for t in (dout, q, k, v)), bias,
                                    False, scale, dropout_p, seed_of(rng))[:3]
    for buf, val in zip((dq, dk, dv), grads):
        buf.copy_(_from_bhld(val, varlen))
    return dq, dk, dv, ws


@flash_attn_bwd.register_fake
def _(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, rng, dropout_p, scale, causal, window_left,
      window_right):
    return _bwd_buffers(q, k, v, cu_seqlens_q)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, dropout_p, scale, causal, wl, wr, softcap = inputs
    out, lse, rng = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng)      # FlashAttn*Func (Note 2)
    ctx.mark_non_differentiable(lse, rng)
    ctx.args = (dropout_p, scale, causal, wl, wr)


def _backward(ctx, dout, *_unused):
    q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
    dq, dk, dv, ws = torch.ops.memfit.flash_attn_bwd(dout, q, k, v, cu_q, cu_k, rng, *ctx.args)
    del ws                                          # workspace dies inside the call (Note 3)
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("memfit::flash_attn_fwd", _backward,
                                setup_context=_setup_context)


def _pad8(t: Tensor) -> Tensor:
    rest = t.shape[-1] % 8
    return t if rest == 0 else F.pad(t, [0, 8 - rest])


def _flash(q, k, v, cu_q, cu_k, dropout_p, scale, causal, window, softcap) -> Tensor:
    """``flash_attn_varlen_func`` (cu_q given) or ``flash_attn_func``: the Python side of
    Note 2 around the kernel op."""
    head = q.shape[-1]
    scale = scale if scale is not None else head ** -0.5
    out = torch.ops.memfit.flash_attn_fwd(_pad8(q), _pad8(k), _pad8(v), cu_q, cu_k,
                                          float(dropout_p), float(scale), bool(causal),
                                          window[0], window[1], float(softcap or 0.0))[0]
    return out if out.shape[-1] == head else out[..., :head]


# -- transformers' attention function, with the flash-attn calls modelled (Note 1) --------------
def flash_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, is_causal: bool | None = None,
                            s_aux=None, **kwargs):
    """transformers' ``flash_attention_forward`` for flash-attn 2, its kernels memfit's ops."""
    from transformers.modeling_flash_attention_utils import fa_peft_integration_check

    ctx = _innermost()
    if s_aux is not None:
        raise ValueError("attention sinks (s_aux) need flash_attention_3 or later; memfit models "
                         "flash_attention_2: use attn_implementation='eager' or 'sdpa'")
    seq_len = query.shape[2]
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:
        value = F.pad(value, [0, head_dim - v_head_dim])
    query, key, value = fa_peft_integration_check(query, key, value,
                                                  _target_dtype(query, module))
    ctx.check(query)
    causal = is_causal if is_causal is not None else module.is_causal
    window = (-1, -1)
    if sliding_window is not None and key.size(1) > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    call = lambda q, k, v, cu_q=None, cu_k=None: _flash(  # noqa: E731
        q, k, v, cu_q, cu_k, dropout, scaling, causal, window, softcap)
    out = _dispatch(ctx, call, query, key, value, attention_mask, seq_len, kwargs)
    return (out if v_head_dim == head_dim else out[..., :v_head_dim]), None


def _target_dtype(query: Tensor, module) -> torch.dtype | None:
    """transformers' ``get_target_dtype`` as on a GPU: the trace's tensors are CPU fakes, so
    the autocast state asked is CUDA's (``CudaAutocastMode`` sets it), not the tensors' device's."""
    if query.dtype != _F32:
        return None
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    if hasattr(module.config, "_is_quantized"):
        return module.config.dtype
    return next(m for m in module.modules() if isinstance(m, torch.nn.Linear)).weight.dtype


def _dispatch(ctx, call, query, key, value, attention_mask, seq_len, kwargs) -> Tensor:
    """Paths (a)-(d) of Note 1, in ``_flash_attention_forward``'s order."""
    from transformers.modeling_flash_attention_utils import (_is_packed_sequence, _pad_input,
                                                             _prepare_from_posids, _unpad_input,
                                                             _upad_input)

    batch_size = query.size(0)
    if attention_mask is not None:
        q, k, v, indices_q, (cu_q, cu_k), _ = _upad_input(query, key, value, attention_mask,
                                                          seq_len, _unpad_input)
        ctx.record("padded", cu_q, q)
        return _pad_input(call(q, k, v, cu_q, cu_k), indices_q, batch_size, seq_len)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and kwargs.get("max_length_q") is not None \
            and kwargs.get("max_length_k") is not None:
        q, k, v = (x.reshape(-1, *x.shape[-2:]) for x in (query, key, value))
        ctx.record("varlen", cu_q, q)
        out = call(q, k, v, cu_q, cu_k)
        return out.view(batch_size, -1, *out.shape[-2:])
    position_ids = kwargs.get("position_ids")
    if _is_packed_sequence(position_ids, batch_size):
        q, k, v, (cu_q, cu_k), _ = _prepare_from_posids(query, key, value, position_ids)
        ctx.record("varlen", cu_q, q)
        out = call(q, k, v, cu_q, cu_k)
        return out.view(batch_size, -1, *out.shape[-2:])
    ctx.record("dense", None, query)
    return call(query, key, value)


# -- the context ----------------------------------------------------------------------------------
def is_open() -> bool:
    """Whether a ``FlashAttn`` context is open (in any thread: the mapping is process-wide)."""
    with _lock:
        return bool(_stack)


def _innermost() -> "FlashAttn":
    with _lock:
        if not _stack:
            raise RuntimeError("memfit's flash_attention_2 ran outside a FlashAttn context")
        return _stack[-1]


class FlashAttn:
    """While open, a model configured with ``attn_implementation="flash_attention_2"`` runs
    flash-attn 2 as a GPU of ``compute_capability`` would (Notes 1-4); ``calls`` counts the
    paths taken ("varlen", "padded", "dense") and ``sequences``/``tokens`` what varlen saw."""

    def __init__(self, compute_capability: tuple[int, int], gpu_name: str = "this GPU"):
        self.compute_capability = tuple(compute_capability)
        self.gpu_name = gpu_name
        self.calls: Counter[str] = Counter()
        self.shapes: set[tuple[int, int]] = set()     # varlen (sequences, tokens) seen

    def check(self, q: Tensor) -> None:
        """Note 4: what flash-attn 2 refuses, refused with the fix."""
        major, minor = self.compute_capability
        if major < 8:
            raise ValueError(f"flash_attention_2 needs an Ampere or newer GPU (sm80+); the "
                             f"{self.gpu_name} is sm{major}{minor}, where flash-attn refuses to "
                             "run: use attn_implementation='sdpa'")
        if q.dtype not in _HALF:
            raise ValueError(f"flash_attention_2 runs in fp16 or bf16 only, and this step's "
                             f"attention inputs are {q.dtype}: train in bf16 or fp16 "
                             "(precision='bf16'), or use attn_implementation='sdpa'")
        if q.shape[-1] > 256:
            raise ValueError(f"flash-attn 2 takes head dims up to 256, this model's is "
                             f"{q.shape[-1]}: use attn_implementation='sdpa'")

    def record(self, path: str, cu_q: Tensor | None, q: Tensor) -> None:
        self.calls[path] += 1
        if cu_q is not None:
            self.shapes.add((cu_q.numel() - 1, q.shape[0]))

    def note(self) -> str | None:
        """The estimate's words on the flash-attn calls (Note 2), None when none ran."""
        if not self.calls:
            return None
        paths = ", ".join(f"{n}x {p}" for p, n in sorted(self.calls.items()))
        seen = "; ".join(f"{b} sequences in {t} tokens" for b, t in sorted(self.shapes))
        return (f"flash_attention_2 on the {self.gpu_name}: {paths}"
                + (f" ({seen})" if seen else "") + ". Modelled from flash-attn 2.8.3's "
                "flash_api.cpp: saved q, k, v, out, logsumexp (fp32, one per head and token) and "
                "cu_seqlens; backward workspace softmax_d and dq_accum (fp32, 128 rows of slack "
                "per sequence), GQA's expanded dk/dv. Not modelled: the dense kernel's split-KV "
                "buffers (small calls only) and the deterministic backward")

    def __enter__(self) -> "FlashAttn":
        global _original
        try:
            from transformers.modeling_utils import AttentionInterface
        except ImportError:              # no transformers: nothing to map
            return self
        with _lock:
            if not _stack:
                _original = AttentionInterface._global_mapping.get(IMPLEMENTATION)
                AttentionInterface.register(IMPLEMENTATION, flash_attention_forward)
            _stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        global _original
        with _lock:
            if self not in _stack:
                return
            _stack.remove(self)
            if not _stack and _original is not None:
                from transformers.modeling_utils import AttentionInterface

                AttentionInterface.register(IMPLEMENTATION, _original)
                _original = None
