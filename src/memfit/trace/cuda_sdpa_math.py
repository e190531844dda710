"""True values of the fused attention kernels on real CPU tensors (for ``cuda_sdpa``'s ops).

Under a fake trace only the sizes of ``memfit::sdpa_fwd`` / ``sdpa_bwd``'s outputs matter; on
real CPU tensors the same buffers are filled with what the kernels compute, in fp32 (softmax
with its log-sum-exp, dropout from the op's seed, grouped key/value heads summed back), so that
results and gradients can be checked against plain SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["seed_of", "attention_fp32", "attention_backward_fp32"]


def seed_of(seed: Tensor) -> int:
    return int(seed.view(torch.int64).reshape(-1)[0])


def _probs_fp32(q, k, bias, is_causal, scale):
    q, k = q.float(), k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.float()
    if is_causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)   # fully masked rows: 0
    return probs, lse


def _dropout_keep(shape, dropout_p, seed, device):
    if dropout_p == 0:
        return None
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen) >= dropout_p).to(device) / (1 - dropout_p)


def attention_fp32(q, k, v, bias, is_causal, scale, dropout_p, seed):
    probs, lse = _probs_fp32(q, k, bias, is_causal, scale)
    keep = _dropout_keep(probs.shape, dropout_p, seed, probs.device)
    dropped = probs if keep is None else probs * keep
    vr = v.float().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return dropped @ vr, lse, probs


def _group_sum(t: Tensor, heads: int) -> Tensor:
    b, h, s, d = t.shape
    return t.view(b, heads, h // heads, s, d).sum(2)


def attention_backward_fp32(grad_out, q, k, v, bias, is_causal, scale, dropout_p, seed):
    probs, _ = _probs_fp32(q, k, bias, is_causal, scale)
    keep = _dropout_keep(probs.shape, dropout_p, seed, probs.device)
    g = q.shape[1] // k.shape[1]
    kr, vr = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    do = grad_out.float()
    dropped = probs if keep is None else probs * keep
    dv = dropped.transpose(-2, -1) @ do
    dp = do @ vr.transpose(-2, -1)
    if keep is not None:
        dp = dp * keep
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
    dq = ds @ kr * scale
    dk = ds.transpose(-2, -1) @ q.float() * scale
    return dq, _group_sum(dk, k.shape[1]), _group_sum(dv, v.shape[1]), ds
