"""``memfit train``'s library: fine-tune a Hugging Face sequence classifier on a CSV/JSONL file
within a memory budget, planned by ``memfit.plan`` and run by ``memfit.fit``'s Runner.

Files, one job each: ``data`` (read and check the file, Hugging Face ``datasets``),
``tokenizer`` (a local one, or one trained on the data with ``tokenizers``), ``batching``
(length-grouped, dynamically padded batches), ``model`` (the classifier), ``setup`` (checks,
plan and Runner), ``loop`` (steps, evaluation, Ctrl-C), ``checkpoint`` (atomic, verified),
``metrics`` (ROC AUC, accuracy, the metrics JSONL), ``plots``, ``progress``, ``synthetic`` (a
multilingual toxic-comment CSV with a learnable rule). ``datasets`` and ``tokenizers`` are
imported when a run starts (``pip install 'memfit[train]'``).
"""

from __future__ import annotations

from memfit.train.config import TrainConfig
from memfit.train.synthetic import make_toxic_csv

__all__ = ["TrainConfig", "train", "make_toxic_csv", "RunResult"]


def __getattr__(name: str):
    if name in ("train", "RunResult"):
        from memfit.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'memfit.train' has no attribute {name!r}")
