"""The classifier of a run: a zoo model with random weights from its config (or its tiny twin),
or a local ``from_pretrained`` folder, with its vocabulary and padding id checked against the
tokenizer's and its position limit against ``--max-len``."""

from __future__ import annotations

import os

__all__ = ["build_classifier", "max_tokens"]

TASK = "sequence-classification"


def build_classifier(name: str, *, num_labels: int, encoder, tiny: bool, weights: str | None,
                     device: str, seed: int):
    """The model in train mode on ``device``. Random weights are seeded by ``seed``; with a
    tokenizer trained on the data (or ``tiny``) the vocabulary is the tokenizer's."""
    from memfit import zoo
    from transformers.utils import logging

    logging.set_verbosity_error()
    if weights is not None:
        return _pretrained(weights, num_labels, encoder, device)
    spec = zoo.get(name)
    overrides = {"num_labels": num_labels, "pad_token_id": encoder.pad_id}
    if tiny or encoder.source == "trained on the data":
        overrides["vocab_size"] = encoder.vocab_size
    model = spec.build(TASK, tiny=tiny, device=device, seed=seed, **overrides)
    _check_vocab(model, encoder, f"{name}{' (tiny)' if tiny else ''}")
    return model


def _pretrained(folder: str, num_labels: int, encoder, device: str):
    from transformers import AutoModelForSequenceClassification

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--weights {folder}: no such folder")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=num_labels, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"--weights {folder}: not a from_pretrained folder transformers can "
                         f"load ({str(e).splitlines()[0][:200]})") from e
    _check_vocab(model, encoder, folder)
    return model.to(device).train()


def _check_vocab(model, encoder, what: str) -> None:
    rows = model.get_input_embeddings().num_embeddings
    if encoder.vocab_size > rows:
        raise ValueError(f"the tokenizer ({encoder.source}) has {encoder.vocab_size} tokens but "
                         f"{what} embeds {rows}: use the model's own tokenizer (--tokenizer DIR)")


def max_tokens(model) -> int | None:
    """The longest row the model takes (RoBERTa's positions start at padding_idx + 1)."""
    from memfit.zoo._batches import position_limit

    return position_limit(model.config)[0]
