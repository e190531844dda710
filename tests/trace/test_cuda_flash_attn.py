"""flash-attn 2 on the CPU (``memfit.trace.cuda_flash_attn``): buffers, values, dispatch, refusals.

Oracles: buffer and saved bytes are counted by hand from flash-attn 2.8.3's ``flash_api.cpp``
and ``flash_attn_interface.py`` (the module's Note 2, each formula named where it is used);
values and gradients against plain ``F.scaled_dot_product_attention`` run per sequence; a tiny
Llama configured with ``flash_attention_2`` against the same model under sdpa, whose packed mask
is transformers' own (``masking_utils``).
"""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memfit import zoo
from memfit.trace.cuda_flash_attn import FlashAttn, _flash, is_open

BF16, F32 = torch.bfloat16, torch.float32
A100, T4 = (8, 0), (7, 5)


def r(x, m):
    return (x + m - 1) // m * m


class _Watch(TorchDispatchMode):
    """The bytes and liveness of what ``memfit::flash_attn_bwd`` returns as workspace."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.memfit.flash_attn_bwd.default:
            self.bytes = [t.untyped_storage().nbytes() for t in out[3]]
            self.refs = [weakref.ref(t.untyped_storage()) for t in out[3]]
        return out


def _saved_and_workspace(q_shape, kv_shape, cu=None, dtype=BF16):
    """(bytes autograd saves, each workspace buffer's bytes) for one call on fakes."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    watch = _Watch()
    with FakeTensorMode():
        q = torch.empty(q_shape, dtype=dtype, requires_grad=True)
        k, v = (torch.empty(kv_shape, dtype=dtype, requires_grad=True) for _ in range(2))
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _flash(q, k, v, cu_t, cu_t, 0.0, None, True, (-1, -1), None)
        with watch:
            out.sum().backward()
        assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, k.shape]
    assert all(ref() is None for ref in watch.refs)       # born in the op, dead right after it
    return sum(seen.values()), watch.bytes


def test_varlen_saves_qkv_out_lse_cu_seqlens_rng():
    T, H, D = 96, 4, 64
    saved, _ = _saved_and_workspace((T, H, D), (T, H, D), cu=[0, 40, 64, 96])
    # q, k, v, out_padded (bf16) + softmax_lse [H, T] fp32 (mha_varlen_fwd) + cu_seqlens (one
    # tensor passed as q's and k's: int32 [4]) + rng_state [2] int64
    assert saved == 4 * T * H * D * 2 + H * T * 4 + 4 * 4 + 16


def test_varlen_backward_workspace_has_128_rows_of_slack_per_sequence():
    T, H, Hk, D, B = 96, 8, 2, 64, 3
    _, ws = _saved_and_workspace((T, H, D), (T, Hk, D), cu=[0, 40, 64, 96])
    rows = T + 128 * B                                        # mha_varlen_bwd
    assert ws == [H * rows * 4,                               # softmax_d [H, T + 128 B] fp32
                  rows * H * r(D, 32) * 4,                    # dq_accum [T + 128 B, H, Dr] fp32
                  T * H * D * 2, T * H * D * 2]               # dk/dv_expanded [T, H, D] (GQA)


def test_dense_buffers_and_head_dim_padding():
    B, L, H, D = 2, 100, 4, 12                                # D padded to 16 in Python
    saved, ws = _saved_and_workspace((B, L, H, D), (B, L, H, D))
    Dp = 16
    # q, k, v padded copies, out_padded [B, L, H, 16] + softmax_lse [B, H, L] fp32 + rng_state
    assert saved == 4 * B * L * H * Dp * 2 + B * H * L * 4 + 16
    # mha_bwd: softmax_d [B, H, r(L, 128)] and dq_accum [B, r(L, 128), H, r(16, 32)], fp32
    assert ws == [B * H * r(L, 128) * 4, B * r(L, 128) * H * 32 * 4]


@pytest.mark.parametrize("hk", [4, 2])
@pytest.mark.parametrize("varlen", [True, False])
def test_values_and_grads_match_sdpa_per_sequence(varlen, hk):
    torch.manual_seed(0)
    H, D, lengths = 4, 16, [7, 12, 5]
    T = sum(lengths)
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    shape_q, shape_kv = ((T, H, D), (T, hk, D)) if varlen else ((3, 8, H, D), (3, 8, hk, D))
    q = torch.randn(shape_q, requires_grad=True)
    k, v = (torch.randn(shape_kv, requires_grad=True) for _ in range(2))
    out = _flash(q, k, v, cu if varlen else None, cu if varlen else None, 0.0, None, True,
                 (-1, -1), None)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)

    def ref(q, k, v):          # [.., L, H, D] -> SDPA's [H, L, D] per sequence
        t = lambda x: x.transpose(-3, -2)                     # noqa: E731
        return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True,
                                                enable_gqa=hk != H))
    if varlen:
        spans = list(zip(cu.tolist(), cu.tolist()[1:]))
        expected = torch.cat([ref(q[a:b], k[a:b], v[a:b]) for a, b in spans])
    else:
        expected = ref(q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v), g)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _tiny_llama(attn):
    m = zoo.get("llama-1b").build("causal-lm", tiny=True, attn_implementation=attn)
    m.config.use_cache = False
    return m


def test_a_packed_llama_runs_varlen_and_equals_its_sdpa_twin(monkeypatch):
    monkeypatch.setattr(FlashAttn, "check", lambda self, q: None)     # fp32, to compare closely
    sdpa, flash = _tiny_llama("sdpa"), _tiny_llama("flash_attention_2")
    batch = zoo.packed_batch(sdpa, [9, 5, 14])
    want = sdpa(**batch)
    want.loss.backward()
    with FlashAttn(A100, "A100") as fa:
        got = flash(**batch)
        got.loss.backward()
    assert dict(fa.calls) == {"varlen": 2} and fa.shapes == {(3, 28)}
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(flash.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert "2x varlen (3 sequences in 28 tokens)" in fa.note()


def test_padding_takes_the_unpadded_varlen_path(monkeypatch):
    monkeypatch.setattr(FlashAttn, "check", lambda self, q: None)
    sdpa, flash = _tiny_llama("sdpa"), _tiny_llama("flash_attention_2")
    spec = zoo.get("llama-1b")
    batch = spec.make_batch(sdpa, 3, seq_len=16, padded=True)
    with FlashAttn(A100) as fa:
        got = flash(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], sdpa(**batch).logits[real], rtol=1e-5, atol=1e-5)
    assert dict(fa.calls) == {"padded": 2}


@pytest.mark.parametrize("sm, dtype, needle", [
    (T4, BF16, "sm80+"), (A100, F32, "fp16 or bf16 only")])
def test_what_flash_attn_refuses_is_refused_with_the_fix(sm, dtype, needle):
    model = _tiny_llama("flash_attention_2").to(dtype)
    batch = zoo.packed_batch(model, [4, 4])
    with FlashAttn(sm, "GPU"), pytest.raises(ValueError, match=needle):
        model(**batch)


def test_the_mapping_is_transformers_own_outside_the_context():
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.modeling_utils import AttentionInterface

    mapping = AttentionInterface._global_mapping
    with FlashAttn(A100):
        with FlashAttn(A100):
            assert is_open() and mapping["flash_attention_2"] is not flash_attention_forward
        assert is_open()
    assert not is_open() and mapping["flash_attention_2"] is flash_attention_forward
