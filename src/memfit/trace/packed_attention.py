"""What attention a packed (padding-free) batch gets, in the estimate's words.

Note 1 (what transformers does with packed position_ids, transformers 5.x). A packed row holds
several sequences whose ``position_ids`` restart (``DataCollatorWithFlattening``; counted here as
``masking_utils.find_packed_sequence_indices`` counts them: a position not one past the previous
one starts a sequence). The attention implementation decides the memory:
- ``flash_attention_2``: ``flash_attn_varlen_func`` over the sequences (``trace.cuda_flash_attn``):
  nothing grows with tokens squared.
- ``sdpa``: ``create_causal_mask`` builds a block-diagonal causal bool mask [1, 1, N, N] for N
  tokens; with a mask SDPA cannot run flash, and with grouped-query attention transformers
  repeats key and value to all heads (``use_gqa_in_sdpa`` is false with a mask). On a GPU the
  memory-efficient (or cuDNN) kernel then keeps the mask, converted to an additive [N, N] bias in
  the activations' dtype, per layer for the backward.
- ``eager``: the same mask as an additive float tensor, and N x N scores per head.
The mask is built only when the forward has no cache: ``_preprocess_mask_arguments`` looks for
packed sequences only when ``cache is None``, and a causal LM's forward builds a DynamicCache
whenever ``use_cache`` resolves True (``config.use_cache``, True in most configs), training or
not, unless gradient checkpointing is on. Then each sequence attends to the ones before it, which
is wrong for training; the HF Trainer sets ``config.use_cache = False`` (``TrainingArguments.
use_cache``), and so does memfit's CLI with ``--packing``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from memfit.trace.cuda_flash_attn import is_open as flash_attn_open
from memfit.units import format_bytes

__all__ = ["packed_sequences", "packing_note", "check_attention_device", "uses_cache"]


def packed_sequences(batch) -> tuple[int, int] | None:
    """(sequences, tokens) of a packed batch (Note 1), or None when the batch is not packed."""
    pos = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] < 2 \
            or pos.device.type == "meta":
        return None
    diff = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    starts = int((diff != 1).sum())
    return (starts + pos.shape[0], pos.numel()) if starts else None


def _attn(model) -> str | None:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def check_attention_device(model, device_kind: str, sharded: bool = False) -> None:
    """flash-attn has no CPU kernel: a CPU estimate of such a model is refused with the fix (the
    real CPU step fails as well), unless the caller opened a ``FlashAttn`` context to run its
    model on CPU tensors; memfit models it on one GPU, not on a sharded rank yet."""
    if _attn(model) != "flash_attention_2":
        return
    if device_kind != "cuda" and not flash_attn_open():        # a caller's own FlashAttn: tests
        raise ValueError("this model runs attn_implementation='flash_attention_2', which has no "
                         "CPU kernel (the real CPU step fails too): estimate for a GPU "
                         "(device='rtx-4090'), or set the model's attention to sdpa")
    if sharded:
        raise ValueError("flash_attention_2 is modelled on one GPU, not yet on a sharded rank "
                         "(gpus > 1): estimate one GPU, or use sdpa for the sharded estimate")


def uses_cache(model, batch) -> bool:
    """Whether the model's forward builds a KV cache for this batch (transformers' rule)."""
    value = batch.get("use_cache") if isinstance(batch, Mapping) else None
    if value is None:
        value = getattr(getattr(model, "config", None), "use_cache", False)
    checkpointed = model.training and any(getattr(m, "gradient_checkpointing", False) is True
                                          for m in model.modules())     # transformers' rule
    return bool(value) and not checkpointed


def packing_note(model, batch, sdpa_calls: list[str] | None = None,
                 device_name: str | None = None) -> str | None:
    """The estimate's words on a packed batch's attention (Note 1); None when not packed."""
    found = packed_sequences(batch)
    if found is None:
        return None
    seqs, tokens = found
    head = f"packed batch: {seqs} sequences in {tokens} tokens (position_ids restart)"
    attn = _attn(model)
    if attn == "flash_attention_2":
        return head + ("; flash_attention_2 runs flash_attn_varlen_func on them: no tokens x "
                       "tokens mask")
    if uses_cache(model, batch):
        return head + (f", but the forward builds a cache (config.use_cache is True), and "
                       f"transformers then ignores the packing under {attn}: each sequence "
                       "attends to the ones before it, and no mask is made. Set "
                       "model.config.use_cache = False, as the HF Trainer does, for the real "
                       "packed step")
    mask = format_bytes(tokens * tokens)
    ran = ""
    if sdpa_calls and device_name:
        kinds = ", ".join(sorted(set(sdpa_calls)))
        ran = f"; on the {device_name} SDPA ran {kinds} with it"
    return head + (f"; {attn} gets a {tokens}x{tokens} block-diagonal causal mask ({mask} as "
                   f"bool){ran}; flash_attention_2 would run flash_attn_varlen_func without it")
