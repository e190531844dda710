"""Packed (padding-free) batches: several sequences in one row, as transformers flattens them.

Note 1 (the layout). transformers' ``DataCollatorWithFlattening`` (``data/data_collator.py``)
concatenates a batch's sequences into one row of shape (1, total_tokens): ``input_ids``;
``position_ids`` restarting at 0 with each sequence; ``labels`` equal to the ids except -100 at
each sequence's first token (the model shifts labels by one, so the last token of a sequence
predicts nothing rather than the next sequence's first token). No attention mask, no padding.
``packed_batch`` calls that collator itself on random token ids (no special ids, as in the
zoo's other text batches).

Note 2 (tokens per batch). A user of TRL's ``SFTConfig(packing=True)`` (padding-free) gives
``per_device_train_batch_size`` sequences of at most ``max_length`` tokens, flattened into one
row. ``make_batch(..., packing=True)`` takes the same two numbers, ``batch_size`` sequences of
``seq_len`` tokens each (the full case: every packed sequence as long as allowed), so a batch
holds ``batch_size * seq_len`` tokens. ``seq_len`` is held to the model's position limit (each
sequence's positions restart); the row may be longer. Memory depends on the total only, except
flash-attn's backward, which keeps 128 rows of fp32 per sequence (``trace.cuda_flash_attn``):
``packed_batch(model, lengths)`` takes the sequences' real lengths for that.

Note 3 (which models). The model must read ``position_ids`` (its ``forward`` takes them) and be a
causal LM: transformers tells packed sequences apart by where the positions restart, in
``masking_utils.find_packed_sequence_indices`` (sdpa, eager: a block-diagonal causal mask) and
``modeling_flash_attention_utils._is_packed_sequence`` (flash_attention_2: the varlen kernel).
Bidirectional masks (encoders) take no positions, so an encoder would attend across sequences.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import transformers
from torch import nn

from memfit.zoo._batches import position_limit, token_id_range

__all__ = ["packed_batch", "check_packable"]


def check_packable(model_or_class, task: str) -> None:
    """Raise ``ValueError`` unless ``model_or_class`` can take a packed batch (Note 3)."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    if task != "causal-lm":
        raise ValueError(f"packing is for causal LMs (transformers tells packed sequences apart "
                         f"only in a causal mask); the task here is {task}: use --task causal-lm "
                         "on a decoder model, or drop packing")
    if "position_ids" not in inspect.signature(cls.forward).parameters:
        raise ValueError(f"{cls.__name__}.forward takes no position_ids, so it cannot tell packed "
                         "sequences apart: packing needs a model that reads them (Llama, Qwen2, "
                         "Mistral, GPT-2, ...)")


def packed_batch(config_or_model: transformers.PretrainedConfig | nn.Module,
                 lengths: Sequence[int], *, seed: int = 0,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """One row holding sequences of ``lengths`` tokens, as ``DataCollatorWithFlattening``
    makes it (Note 1): ``input_ids``, ``position_ids`` and ``labels`` of shape (1, sum).

    A model whose ``config.use_cache`` is True builds a cache in its forward even in training,
    and then transformers' sdpa and eager masks ignore the packing: set it False, as the Trainer
    does (``docs/packing.md``).
    """
    if isinstance(config_or_model, nn.Module):
        check_packable(config_or_model, "causal-lm")
        config = config_or_model.config
    elif isinstance(config_or_model, transformers.PretrainedConfig):
        config = config_or_model
    else:
        raise ValueError(f"packed_batch needs a transformers config or model, got "
                         f"{type(config_or_model).__name__}")
    lengths = _checked_lengths(config, lengths)
    low, high = token_id_range(config)
    gen = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(low, high, (n,), generator=gen).tolist()}
                for n in lengths]
    batch = transformers.DataCollatorWithFlattening(return_tensors="pt")(features)
    return {k: v.to(device) for k, v in batch.items()}


def _checked_lengths(config, lengths) -> list[int]:
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                          for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of positive ints (tokens per "
                         f"sequence), got {lengths!r}")
    if sum(lengths) < 2:
        raise ValueError("a packed causal-lm batch needs at least 2 tokens: the loss predicts "
                         "token t+1 from token t")
    limit, why = position_limit(config)
    if limit is not None and max(lengths) > limit:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the position limit of "
                         f"this {config.model_type} model: at most {limit} tokens per sequence "
                         f"({why}); the packed row may be longer than that")
    return lengths
