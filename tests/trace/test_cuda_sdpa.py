"""CUDA SDPA on the CPU: backend choice, kernel-sized outputs, saved tensors, workspace, values.

Oracles: the selection table cites the sdp_utils.cpp filter that decides each row; output
sizes are checked against PyTorch's own meta functions for the aten kernels
(``torch.ops.aten._scaled_dot_product_*_attention`` on meta tensors); saved and workspace
bytes are counted by hand from the kernel sources (``cuda_sdpa`` Note 2); values and
gradients against plain ``F.scaled_dot_product_attention`` outside the mode.
"""

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from memfit.trace.cuda_sdpa import CudaBuild, CudaSdpaMode, SdpaInputs, select_backend

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
A100, H100, T4, GTX1080TI, RTX3090 = (8, 0), (9, 0), (7, 5), (6, 1), (8, 6)


def inputs(dtype=F16, b=2, h=4, lq=128, lk=None, d=64, hk=None, **kw):
    lk, hk = lk or lq, hk or h
    return SdpaInputs(q_shape=(b, h, lq, d), k_shape=(b, hk, lk, d), v_shape=(b, hk, lk, d),
                      dtypes=(dtype,) * 3, **kw)


# (name, inputs, compute capability, build, expected backend, deciding rule in sdp_utils.cpp)
OLD_CUDNN = CudaBuild(cudnn_version=91002)           # torch 2.8 cu128 wheels: cuDNN 9.10.2
MASK = dict(mask_shape=(2, 1, 128, 128), mask_dtype=F16)
TABLE = [
    ("1080Ti fp32", inputs(F32), GTX1080TI, CudaBuild(), "efficient",
     "check_flash_attention_hardware_support: flash needs sm80+; efficient runs sm50+ in fp32"),
    ("1080Ti fp16", inputs(F16), GTX1080TI, CudaBuild(), "efficient", "same, fp16 allowed"),
    ("1080Ti bf16", inputs(BF16), GTX1080TI, CudaBuild(), "math",
     "efficient's check_tensor_dtype: bf16 only on sm80+"),
    ("T4 fp16", inputs(F16), T4, CudaBuild(), "efficient",
     "check_flash_attention_hardware_support (sm75 < sm80); cuDNN also needs sm80"),
    ("A100 fp16 causal", inputs(F16, is_causal=True), A100, CudaBuild(), "flash",
     "every flash filter passes; cuDNN is not preferred on sm80"),
    ("A100 fp32", inputs(F32), A100, CudaBuild(), "efficient",
     "check_dtypes_flash_attention: fp16/bf16 only"),
    ("A100 fp16 float mask", inputs(F16, **MASK), A100, CudaBuild(), "efficient",
     "check_for_attn_mask: flash takes no mask"),
    ("A100 fp16 head_dim 512", inputs(F16, d=512), A100, CudaBuild(), "efficient",
     "check_head_dim_size_flash: <= 256; efficient has no upper bound"),
    ("A100 fp16 head_dim 12", inputs(F16, d=12), A100, CudaBuild(), "flash",
     "the composite pads the head dim to a multiple of 8"),
    ("A100 fp32 head_dim 6", inputs(F32, d=6), A100, CudaBuild(), "math",
     "check_head_dim_size_mem_efficient: fp32 on sm80 needs a multiple of 4"),
    ("A100 causal L_q != L_k", inputs(F16, lq=64, lk=128, is_causal=True), A100, CudaBuild(),
     "efficient", "check_flash_causal_non_square_seqlens"),
    ("3090 training head_dim 224", inputs(F16, d=224, requires_grad=True), RTX3090,
     CudaBuild(), "efficient", "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89"),
    ("3090 training head_dim 256", inputs(F16, d=256, requires_grad=True), RTX3090,
     CudaBuild(), "flash", "same check: head_dim > 224 without dropout passes"),
    ("A100 fp16 GQA", inputs(F16, hk=2, enable_gqa=True), A100, CudaBuild(), "flash",
     "check_batch_size_and_num_heads_dense<supports_gqa=true>"),
    ("A100 fp32 GQA", inputs(F32, hk=2, enable_gqa=True), A100, CudaBuild(), "math",
     "efficient: check_batch_size_and_num_heads_dense<supports_gqa=false> in 2.13"),
    ("A100 heads differ, no enable_gqa", inputs(F16, hk=2), A100, CudaBuild(), "math",
     "check_batch_size_and_num_heads_dense: equal heads without enable_gqa"),
    ("A100 misaligned k offset + mask", inputs(F16, storage_offsets=(0, 4, 0), **MASK), A100,
     CudaBuild(), "math", "check_data_ptr_alignment_mem_efficient: 8-element alignment"),
    ("A100 mask that needs grad", inputs(F16, mask_requires_grad=True, **MASK), A100,
     CudaBuild(), "efficient", "flash: check_for_attn_mask; efficient accepts a bias grad"),
    ("H100 bf16", inputs(BF16), H100, CudaBuild(), "cudnn",
     "check_prefer_cudnn_attention: sm90 with cuDNN > 9.15.0 puts cuDNN first"),
    ("H100 bf16, cuDNN 9.10", inputs(BF16), H100, OLD_CUDNN, "flash",
     "check_prefer_cudnn_attention is false: default order flash, efficient, math, cuDNN"),
    ("H100 bf16 head_dim 256", inputs(BF16, d=256), H100, CudaBuild(), "flash",
     "check_cudnn_tensor_shapes: head_dim <= 128 with cuDNN 9.19"),
    ("H100 bf16 dropout 0.1", inputs(BF16, dropout_p=0.1), H100, CudaBuild(), "flash",
     "check_cudnn_dropout: a multiple of 1/16"),
    ("H100 bf16 dropout 0.125", inputs(BF16, dropout_p=0.125), H100, CudaBuild(), "cudnn",
     "check_cudnn_dropout: 0.125 = 2/16 passes"),
    ("H100 bf16 3-D mask", inputs(BF16, mask_shape=(2, 128, 128), mask_dtype=BF16), H100,
     CudaBuild(), "efficient", "check_attn_mask_shape: 2-D or 4-D; flash: no mask"),
    ("H100 bf16 4-D mask", inputs(BF16, mask_shape=(2, 1, 128, 128), mask_dtype=BF16), H100,
     CudaBuild(), "cudnn", "check_attn_mask_shape passes; cuDNN first"),
    ("H100 fp32", inputs(F32), H100, CudaBuild(), "efficient",
     "check_dtypes_low_precision refuses fp32 for cuDNN and flash"),
    ("H100 bf16 GQA", inputs(BF16, hk=2, enable_gqa=True), H100, CudaBuild(), "cudnn",
     "cuDNN: check_batch_size_and_num_heads_dense<true, false>"),
    ("sm100 bf16, CUDA 12 build", inputs(BF16), (10, 0), CudaBuild(cuda_major=12), "cudnn",
     "check_prefer_cudnn_attention: minor 0 passes with CUDA < 13"),
    ("sm101 bf16, CUDA 12 build", inputs(BF16), (10, 1), CudaBuild(cuda_major=12), "flash",
     "check_prefer_cudnn_attention: minor 1 fails with CUDA < 13"),
]


@pytest.mark.parametrize("name, p, sm, build, expected, rule", TABLE, ids=[r[0] for r in TABLE])
def test_selection_table(name, p, sm, build, expected, rule):
    assert select_backend(p, sm, build) == expected, rule


def test_no_backend_left_is_an_error():
    with pytest.raises(ValueError, match="No available kernel"):
        select_backend(inputs(F32, d=6), A100, enabled=frozenset({"flash", "efficient"}))


def test_inputs_from_tensors():
    q = torch.randn(2, 6, 4, 8, requires_grad=True)
    kv = torch.randn(2, 10, 2, 8).transpose(1, 2)        # [B, H, S, D] view of [B, S, H, D]
    p = SdpaInputs.from_tensors(q, kv[:, 1:], kv[:, 1:], torch.ones(4, 9, dtype=torch.bool),
                                enable_gqa=True)
    assert p.k_shape == (2, 1, 10, 8) and p.storage_offsets == (0, 8, 8)
    assert p.requires_grad and p.mask_shape == (4, 9) and p.has_mask


# -- kernel-sized outputs: PyTorch's meta functions are the oracle -------------------------------
def _meta(*shape, dtype=F16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _layout(ts):
    return [(tuple(t.shape), t.dtype, t.stride()) for t in ts]


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
def test_fwd_outputs_match_pytorch_meta(backend):
    B, H, L, D = 2, 4, 100, 64
    q = _meta(B, H, L, D)
    aten = torch.ops.aten
    if backend == "flash":       # (output, logsumexp, ..., rng_state, unused, debug_mask)
        ref = aten._scaled_dot_product_flash_attention(q, q, q)
        ref = [ref[i] for i in (0, 1, 6, 7)]
    elif backend == "efficient":     # (output, log_sumexp, philox_seed, philox_offset)
        ref = aten._scaled_dot_product_efficient_attention(q, q, q, None, True)
    else:                            # (output, logsumexp, ..., philox_seed, philox_offset, ...)
        ref = aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)
        ref = [ref[i] for i in (0, 1, 6, 7)]
    with FakeTensorMode():
        qf = torch.empty(B, H, L, D, dtype=F16)
        out = torch.ops.memfit.sdpa_fwd(qf, qf, qf, None, backend, 0.0, False, 0.125, True, 8)
    assert _layout(out[:4]) == _layout(ref)
    lse_width = {"flash": L, "efficient": 128, "cudnn": L}[backend]   # 128 = ceil(100/32)*32
    assert out[1].shape[2] == lse_width and out[1].dtype == F32


def test_efficient_bwd_grads_match_pytorch_meta():
    B, H, L, S, D = 2, 4, 100, 90, 64
    q, k, bias = _meta(B, H, L, D), _meta(B, H, S, D), _meta(B, H, L, S)
    lse, zero = _meta(B, H, 128, dtype=F32), _meta(dtype=torch.int64)
    ref = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        q, q, k, k, bias, q, lse, zero, zero, 0.0, [True] * 4)
    with FakeTensorMode():
        qf, kf, bf = (torch.empty(t.shape, dtype=F16) for t in (q, k, bias))
        lf, zf = torch.empty(B, H, 128), torch.empty((), dtype=torch.int64)
        got = torch.ops.memfit.sdpa_bwd(qf, qf, kf, kf, bf, qf, lf, zf, zf, "efficient", 0.0,
                                        False, 0.125, True, 8)
    assert _layout(got[:4]) == _layout(ref)     # grad_bias: last dim 90 padded to 96, sliced
    assert got[3].untyped_storage().nbytes() == B * H * L * 96 * 2


# -- saved tensors and workspace ----------------------------------------------------------------
def _saved_bytes(fn):
    """Bytes of the distinct storages autograd saves while ``fn`` runs."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_flash_saves_qkv_out_lse_rng_and_no_attention_matrix():
    B, H, L, D = 2, 4, 256, 64
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)   # noqa: E731
    with FakeTensorMode():
        q, k, v = (torch.empty(B, H, L, D, dtype=F16, requires_grad=True) for _ in range(3))
        mode = CudaSdpaMode(A100)
        with mode:
            saved, _ = _saved_bytes(sdpa)
        with sdpa_kernel(SDPBackend.MATH):
            math_saved, _ = _saved_bytes(sdpa)
    assert mode.calls == ["flash"]
    # q, k, v, out (fp16) + logsumexp [B, H, L] fp32 + rng_state [2] uint64 + unused [] uint64
    assert saved == 4 * B * H * L * D * 2 + B * H * L * 4 + 16 + 8
    assert math_saved >= B * H * L * L * 4 > saved     # softmax's fp32 [B, H, L, L] output


class _WorkspaceWatch(TorchDispatchMode):
    """Records the workspace storages ``memfit::sdpa_bwd`` returns, by weak reference."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.memfit.sdpa_bwd.default:
            self.bytes = [t.untyped_storage().nbytes() for t in out[4]]
            self.refs = [weakref.ref(t.untyped_storage()) for t in out[4]]
        return out


def _fake_fwd_bwd(sm, dtype, b, h, lq, d, hk=None, mask=None):
    """Forward and backward on fakes laid out as HF does: [B, L, H, D] viewed as [B, H, L, D]."""
    watch = _WorkspaceWatch()
    with FakeTensorMode():
        hk = hk or h
        q = torch.empty(b, lq, h, d, dtype=dtype, requires_grad=True)
        k, v = (torch.empty(b, lq, hk, d, dtype=dtype, requires_grad=True) for _ in range(2))
        mode = CudaSdpaMode(sm)
        with mode:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), attn_mask=mask,
                                               enable_gqa=hk != h)
        with watch:
            o.transpose(1, 2).sum().backward()
        grads = [t.grad.shape for t in (q, k, v)]
    assert grads == [(b, lq, h, d), (b, lq, hk, d), (b, lq, hk, d)]
    assert all(r() is None for r in watch.refs)       # born in the op, dead right after it
    return mode.calls, watch.bytes


def test_flash_backward_workspace_is_born_and_freed():
    B, H, L, D = 2, 4, 100, 64
    calls, ws = _fake_fwd_bwd(A100, F16, B, H, L, D)
    assert calls == ["flash"]
    grad_out_copy = B * L * H * D * 2     # the grad of .sum() is an expanded (stride-0) tensor
    softmax_d = B * H * 128 * 4           # [B, H, r(L, 128)] fp32
    dq_accum = B * 128 * H * 64 * 4       # [B, r(L, 128), H, r(D, 32)] fp32
    assert ws == [grad_out_copy, softmax_d, dq_accum]     # out's [B, L, H, D] view is contiguous


def test_flash_gqa_backward_allocates_expanded_dk_dv():
    B, H, Hk, L, D = 1, 8, 2, 64, 32
    calls, ws = _fake_fwd_bwd(A100, BF16, B, H, L, D, hk=Hk)
    assert calls == ["flash"]
    assert ws[-2:] == [B * L * H * D * 2] * 2     # dk_expanded, dv_expanded [B, S, H, D] bf16


def test_efficient_backward_workspace():
    B, H, L, D = 2, 4, 100, 64
    calls, ws = _fake_fwd_bwd(A100, F32, B, H, L, D)
    assert calls == ["efficient"]
    delta = B * H * L * 4
    # fp32, head_dim 64: kMaxK 64, bi = bj = 64; grad_q accumulator r(100, 64) x r(64, 64) fp32
    kernel = B * H * 128 * 64 * 4
    assert ws == [B * L * H * D * 4, delta, kernel]


# -- true values on real CPU tensors --------------------------------------------------------------
CASES = [  # (sm, dtype, head_dim, kv heads, mask kind, causal, expected backend)
    (A100, BF16, 16, 4, None, True, "flash"),
    (A100, BF16, 12, 4, None, False, "flash"),       # padded head dim
    (A100, BF16, 16, 2, None, True, "flash"),        # GQA
    (A100, F32, 16, 4, "bool", False, "efficient"),
    (A100, F32, 16, 4, "float_grad", False, "efficient"),
    (H100, BF16, 16, 4, "bool", False, "cudnn"),
    (A100, F32, 16, 2, None, False, "math"),         # GQA in fp32
]


@pytest.mark.parametrize("sm, dtype, d, hk, mask_kind, causal, expected", CASES)
def test_values_and_grads_match_plain_sdpa(sm, dtype, d, hk, mask_kind, causal, expected):
    torch.manual_seed(0)
    B, H, L, S = 2, 4, 8, 8
    q = torch.randn(B, H, L, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, hk, S, d, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(B, 1, L, S) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float_grad":
        mask = torch.randn(L, S, dtype=dtype, requires_grad=True)
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    kw = dict(attn_mask=mask, is_causal=causal, enable_gqa=hk != H)
    mode = CudaSdpaMode(sm)
    with mode:
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, grad)
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    want = torch.autograd.grad(ref, leaves, grad)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == BF16 else dict(atol=1e-5, rtol=1e-4)
    assert mode.calls == [expected]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


def test_dropout_gradient_is_the_derivative_of_the_forward():
    """With dropout the forward's mask is redrawn from its seed in the backward, so the
    gradient is the true derivative: a central difference along a random direction agrees."""
    B, H, L, D = 1, 2, 6, 8
    x = torch.randn(3, B, H, L, D, dtype=torch.float64)
    direction = torch.randn_like(x)
    grad_out = torch.randn(B, H, L, D)

    def f(t, need_grad=False):
        t = t.float().requires_grad_(need_grad)
        torch.manual_seed(1234)                       # same philox seed each call
        with CudaSdpaMode(A100):
            out = F.scaled_dot_product_attention(t[0], t[1], t[2], dropout_p=0.25)
        return (out * grad_out).sum(), t

    loss, t = f(x, need_grad=True)
    (g,) = torch.autograd.grad(loss, t)
    eps = 1e-3
    numeric = (f(x + eps * direction)[0] - f(x - eps * direction)[0]) / (2 * eps)
    assert math.isclose(float((g.double() * direction).sum()), float(numeric), rel_tol=1e-2)


def test_autocast_casts_inputs_before_the_kernel():
    q = torch.randn(1, 2, 8, 16)
    mode = CudaSdpaMode(A100)
    with mode, torch.autocast("cpu", dtype=BF16):
        out = F.scaled_dot_product_attention(q, q, q)
    assert mode.calls == ["flash"] and out.dtype == BF16


def test_tiny_llama_forward_backward_matches_without_the_mode():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(BF16)
    ids = torch.randint(0, 128, (2, 16))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    mode = CudaSdpaMode(A100)
    with mode:
        loss, grads = step()
    ref_loss, ref_grads = step()
    assert mode.calls == ["flash"]       # bf16, causal, GQA with enable_gqa: flash on sm80
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=5e-2, rtol=5e-2)
