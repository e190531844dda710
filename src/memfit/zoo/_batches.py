"""Synthetic training batches: dicts of tensors, batch dimension first, ``model(**batch).loss`` defined.

Note 1 (token ids). Ids are drawn from ``[low, high)``: ``low`` is one past the largest special
id (pad/bos/eos/...) in the lower half of the vocabulary, ``high`` the smallest special id in the
upper half (GPT-2's 50256, Llama-3's 128000), so no special token is drawn where the config
names it. Random weights make the meaning of ids irrelevant; only their range matters.

Note 2 (padding). With ``padded=True`` row ``i`` of ``B`` keeps ``L - i*(L - ceil(L/2)) // (B-1)``
real tokens: row 0 is full, the last row half full, independent of ``seed``. Padding is on the
right: mask 0, id ``pad_token_id`` (0 when the config has none), label -100.

Note 3 (position limits). RoBERTa-family models number positions from ``padding_idx + 1``, so
``max_position_embeddings=514`` allows 512 tokens; GPT-2 allows ``n_positions``; other models allow
``max_position_embeddings``. No limit: a field that is absent, None or not positive (XLNet's
``max_position_embeddings`` is -1, "no sequence length limit"), relative positions (T5's buckets,
DeBERTa with ``position_biased_input=False``). ``position_limit`` is that length (a rotary model's
trained context counts: batches and searches stay within it); ``table_limit`` is the length past
which the forward fails (a learned or sinusoidal table indexed by position), so a longer batch is
refused only there: rotary positions (``rope_parameters``) and ``position_embedding_type`` other
than "absolute" have no table.

Note 4 (speech and contrastive batches). ``speech-seq2seq`` (Whisper) feeds ``input_features``
of ``num_mel_bins`` x ``2 * max_source_positions`` frames (the length the encoder checks) and
``seq_len`` target tokens as ``labels`` (default 64; padding as Note 2). ``contrastive`` (CLIP)
feeds a text batch from ``text_config`` (ids and mask, no labels), images from
``vision_config`` and ``return_loss=True``: the loss is the symmetric image-text loss.
"""

from __future__ import annotations

import warnings

import torch
import transformers

__all__ = ["TASKS", "make_batch", "position_limit", "table_limit", "token_id_range", "resolve_seq_len",
           "check_positive_int"]

TASKS = ("sequence-classification", "token-classification", "masked-lm", "causal-lm", "seq2seq-lm",
         "image-classification", "speech-seq2seq", "contrastive")
DEFAULT_SEQ_LEN = 256
DEFAULT_IMAGE_SIZE = 224
MLM_PROBABILITY = 0.15
IGNORE_INDEX = -100

_OFFSET_POSITION_TYPES = {"roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "roberta-prelayernorm",
                          "data2vec-text"}
_SPECIAL_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id",
                      "sep_token_id", "cls_token_id", "mask_token_id", "unk_token_id")


def make_batch(config: transformers.PretrainedConfig, task: str, batch_size: int = 8, *,
               seq_len: int | None = None, image_size: int | None = None, padded: bool = False,
               seed: int = 0, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A deterministic (given ``seed``) batch for ``task`` on a model built from ``config``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: valid tasks are {list(TASKS)}")
    check_positive_int("batch_size", batch_size)
    gen = torch.Generator().manual_seed(seed)
    if task == "image-classification":
        if seq_len is not None or padded:
            warnings.warn("seq_len and padded have no effect on an image batch", stacklevel=3)
        batch = _image_batch(config, batch_size, image_size, gen)
    elif task == "speech-seq2seq":
        if image_size is not None:
            warnings.warn("image_size has no effect on a speech batch", stacklevel=3)
        batch = _speech_batch(config, batch_size, seq_len, padded, gen)
    elif task == "contrastive":
        batch = _text_batch(config.text_config, task, batch_size, seq_len, padded, gen)
        batch["pixel_values"] = _image_batch(config.vision_config, batch_size, image_size, gen)["pixel_values"]
        batch["return_loss"] = True
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    else:
        if image_size is not None:
            warnings.warn("image_size has no effect on a text batch", stacklevel=3)
        batch = _text_batch(config, task, batch_size, seq_len, padded, gen)
    return {k: v.to(device) for k, v in batch.items()}


def position_limit(config: transformers.PretrainedConfig) -> tuple[int | None, str]:
    """The longest sequence the model accepts and why (Note 3); ``None`` when unlimited."""
    if getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None:
        return position_limit(config.text_config)       # CLIP-like: seq_len is the text's
    if hasattr(config, "max_target_positions"):          # Whisper-like: seq_len is the target's
        return _bounded(config, "max_target_positions")
    if hasattr(config, "relative_attention_num_buckets"):
        return None, "relative position buckets have no limit"
    if getattr(config, "position_biased_input", None) is False:
        return None, "relative positions only (position_biased_input=False) have no limit"
    field = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
    limit, why = _bounded(config, field)
    if limit is not None and getattr(config, "model_type", "") in _OFFSET_POSITION_TYPES:
        pad = config.pad_token_id or 0
        return limit - pad - 1, (f"{why} minus {pad + 1}, because positions start at "
                                 f"padding_idx + 1 = {pad + 1}")
    return limit, why


def table_limit(config: transformers.PretrainedConfig) -> tuple[int | None, str]:
    """The length past which the model's forward fails (a position table), and why (Note 3)."""
    if getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None:
        return table_limit(config.text_config)
    if getattr(config, "rope_parameters", None) is not None or getattr(config, "rope_theta", None) is not None:
        return None, "rotary positions have no table"
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        return None, f"position_embedding_type {kind!r} has no table"
    return position_limit(config)


def _bounded(config, field: str) -> tuple[int | None, str]:
    """``config.field`` as a limit; absent, None or not positive means none (Note 3)."""
    value = getattr(config, field, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None, f"{field} {value} means no limit"
    return value, f"{field} {value}"


def token_id_range(config: transformers.PretrainedConfig) -> tuple[int, int]:
    """``[low, high)`` of the ids a text batch draws (Note 1)."""
    vocab = config.vocab_size
    specials: set[int] = set()
    for name in _SPECIAL_ID_FIELDS:
        value = getattr(config, name, None)
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and 0 <= v < vocab:
                specials.add(v)
    low = max((s + 1 for s in specials if s < vocab // 2), default=0)
    high = min((s for s in specials if s >= vocab // 2), default=vocab)
    return (low, high) if high - low >= 2 else (0, vocab)


def _text_batch(config, task, batch_size, seq_len, padded, gen) -> dict[str, torch.Tensor]:
    seq_len = resolve_seq_len(config, task, seq_len)
    input_ids, attention_mask = _token_rows(config, batch_size, seq_len, padded, gen)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    if getattr(config, "type_vocab_size", 1) > 1:
        batch["token_type_ids"] = torch.zeros_like(input_ids)
    real = attention_mask.bool()
    if task == "sequence-classification":
        batch["labels"] = _class_labels(config, (batch_size,), gen)
    elif task == "token-classification":
        batch["labels"] = _class_labels(config, (batch_size, seq_len), gen).masked_fill(~real, IGNORE_INDEX)
    elif task == "masked-lm":
        picked = (torch.rand(input_ids.shape, generator=gen) < MLM_PROBABILITY) & real
        picked[~picked.any(dim=1), 0] = True  # every row predicts at least one token
        batch["labels"] = input_ids.masked_fill(~picked, IGNORE_INDEX)
    elif task == "causal-lm":
        batch["labels"] = input_ids.masked_fill(~real, IGNORE_INDEX)  # the model shifts internally
    elif task == "seq2seq-lm":
        target_ids, target_mask = _token_rows(config, batch_size, max(1, seq_len // 4), padded, gen)
        batch["labels"] = target_ids.masked_fill(~target_mask.bool(), IGNORE_INDEX)
    return batch


def _speech_batch(config, batch_size, seq_len, padded, gen) -> dict[str, torch.Tensor]:
    """Note 4: log-mel features of the length the encoder expects, target tokens as labels."""
    frames = 2 * config.max_source_positions        # Whisper's two convolutions, the second stride 2
    features = torch.randn((batch_size, config.num_mel_bins, frames), generator=gen)
    limit = config.max_target_positions
    seq_len = min(DEFAULT_SEQ_LEN // 4, limit) if seq_len is None else seq_len
    check_positive_int("seq_len", seq_len)
    if seq_len > limit:
        raise ValueError(f"seq_len {seq_len} (target tokens) exceeds this {config.model_type} model's "
                         f"max_target_positions {limit}: use seq_len <= {limit}")
    target_ids, target_mask = _token_rows(config, batch_size, seq_len, padded, gen)
    return {"input_features": features, "labels": target_ids.masked_fill(~target_mask.bool(), IGNORE_INDEX)}


def _token_rows(config, batch_size, seq_len, padded, gen) -> tuple[torch.Tensor, torch.Tensor]:
    low, high = token_id_range(config)
    ids = torch.randint(low, high, (batch_size, seq_len), generator=gen)
    lengths = _row_lengths(batch_size, seq_len) if padded else torch.full((batch_size,), seq_len)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    return ids.masked_fill(mask == 0, pad_id), mask


def _row_lengths(batch_size: int, seq_len: int) -> torch.Tensor:
    """Note 2: from ``seq_len`` (row 0) down to ``ceil(seq_len/2)`` (last row)."""
    span = seq_len - (seq_len + 1) // 2
    steps = max(1, batch_size - 1)
    return torch.tensor([seq_len - (i * span) // steps for i in range(batch_size)])


def _class_labels(config, shape, gen) -> torch.Tensor:
    if config.num_labels == 1:  # transformers treats one label as regression: float targets
        return torch.randn(shape, generator=gen)
    return torch.randint(0, config.num_labels, shape, generator=gen)


def resolve_seq_len(config, task, seq_len) -> int:
    limit, why = position_limit(config)
    if seq_len is None:
        seq_len = DEFAULT_SEQ_LEN if limit is None else min(DEFAULT_SEQ_LEN, limit)
    check_positive_int("seq_len", seq_len)
    if limit is not None and seq_len > limit:
        field = why.split()[0]
        raise ValueError(
            f"seq_len {seq_len} exceeds the position limit of this {config.model_type} model: at most "
            f"{limit} tokens ({why}). Use seq_len <= {limit}, or build the model with a larger "
            f"`{field}` override (random weights allow it)."
        )
    if task == "causal-lm" and seq_len < 2:
        raise ValueError("seq_len must be >= 2 for causal-lm: the loss predicts token t+1 from token t")
    return seq_len


def _image_batch(config, batch_size, image_size, gen) -> dict[str, torch.Tensor]:
    configured = getattr(config, "image_size", None)
    size = image_size if image_size is not None else (configured or DEFAULT_IMAGE_SIZE)
    check_positive_int("image_size", size)
    patch = getattr(config, "patch_size", None)
    if configured is not None and patch is not None and configured % patch:
        raise ValueError(f"this {config.model_type} config has image_size {configured}, not a multiple of "
                         f"patch_size {patch}: build it with an image_size override that is one")
    if patch is not None and size % patch:
        options = sorted({max(patch, size // patch * patch), (size // patch + 1) * patch})
        raise ValueError(f"image_size {size} is not a multiple of this {config.model_type} model's patch_size "
                         f"{patch}: use e.g. {' or '.join(map(str, options))}")
    if configured is not None and patch is not None and size != configured:
        raise ValueError(
            f"image_size {size} does not match this {config.model_type} model, which was built for "
            f"{configured}x{configured} images (its position embeddings fix the patch count): build the "
            f"model with spec.build(..., image_size={size}), or pass image_size={configured}."
        )
    channels = getattr(config, "num_channels", 3)
    pixel_values = torch.randn((batch_size, channels, size, size), generator=gen)
    return {"pixel_values": pixel_values, "labels": _class_labels(config, (batch_size,), gen)}


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
