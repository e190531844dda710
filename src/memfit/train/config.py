"""``TrainConfig``: everything a ``memfit train`` run is made of, checked, and saved in its
folder.

Note 1 (the default learning rate follows the weights, issue 26). 2e-5 is the fine-tuning rate
of pretrained encoders (BERT/RoBERTa's papers: 1e-5 to 5e-5): it nudges weights that already
encode language. Random weights (no ``--weights``) must be trained from scratch, where such a
rate moves nothing in a few epochs (a tiny model on a CSV it never saw: AUC 0.54 after 3
epochs at 2e-5, 1.0 at 1e-3). From scratch, the rates that train transformers fall with width
(GPT-3's table: 6e-4 at 125M parameters, 2e-4 at 1.3B; RoBERTa-large pretraining 4e-4): 1e-3
for the tiny twin (width 64), 3e-4 for a full-size model. ``--lr`` overrides; the run says which
it took and why (``TrainConfig.learning_rate``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

__all__ = ["TrainConfig", "PRETRAINED_LR", "RANDOM_LR", "RANDOM_TINY_LR"]

PRETRAINED_LR = 2e-5       # fine-tuning pretrained weights (Note 1)
RANDOM_LR = 3e-4           # random weights, a full-size model, from scratch (Note 1)
RANDOM_TINY_LR = 1e-3      # random weights, the tiny twin (width 64), from scratch (Note 1)


@dataclass(frozen=True)
class TrainConfig:
    """One run. Sizes in tokens and samples, memory in bytes, times in steps (effective batches)."""

    data: str                             # training file (.csv / .tsv / .jsonl)
    output: str                           # the run folder
    text_column: str = "comment_text"
    label_column: str = "toxic"
    model: str = "xlm-roberta-large"      # a zoo name
    tiny: bool = False                    # the zoo model's tiny twin (vocabulary: the tokenizer's)
    weights: str | None = None            # a from_pretrained folder; None: random weights
    tokenizer: str | None = None          # a local tokenizer; None: trained on the data
    vocab_size: int = 8000                # of a tokenizer trained on the data
    eval_data: str | None = None          # evaluation file; None: hold out eval_fraction
    eval_fraction: float = 0.1
    max_len: int = 256                    # tokens per row at most (<s> and </s> included)
    batch_size: int = 32                  # the effective batch, in samples
    epochs: float = 1.0
    max_steps: int | None = None          # stops first if reached before the epochs
    lr: float | None = None               # None: from where the weights come from (Note 1)
    weight_decay: float = 0.01
    warmup_fraction: float = 0.1          # of the steps, linear warm-up, then linear decay to 0
    max_grad_norm: float | None = 1.0
    precision: str = "auto"
    budget_bytes: int | None = None       # device bytes to fit; None: the device's own
    gpu: str | None = None                # the device to plan for; None: where the model runs
    device: str = "cpu"                   # where the model runs: cpu or cuda
    progressive: tuple[int, float] | None = None   # (short length, fraction of steps at it)
    eval_every: int | None = None         # steps between evaluations (None: at the end only)
    save_every: int | None = None         # steps between checkpoints (None: at the end only)
    keep_checkpoints: int = 2
    measure_steps: int = 3                # steps measured on the CPU with memfit.track
    seed: int = 0

    def __post_init__(self):
        def need(ok: bool, flag: str, value, what: str):
            if not ok:
                raise ValueError(f"{flag} {value}: {what}")
        need(self.batch_size >= 1, "--batch-size", self.batch_size, "must be at least 1")
        need(self.epochs > 0, "--epochs", self.epochs, "must be above 0")
        need(self.max_steps is None or self.max_steps >= 1, "--max-steps", self.max_steps,
             "must be at least 1")
        need(self.lr is None or self.lr > 0, "--lr", self.lr, "must be above 0")
        need(0 <= self.warmup_fraction < 1, "--warmup", self.warmup_fraction,
             "is a fraction of the steps, in [0, 1)")
        need(0 < self.eval_fraction < 1, "--eval-fraction", self.eval_fraction,
             "is a fraction of the rows, in (0, 1)")
        need(self.max_len >= 8, "--max-len", self.max_len, "must be at least 8 tokens")
        need(self.vocab_size >= 300, "--vocab-size", self.vocab_size,
             "must be at least 300 (the 256 bytes, the special tokens and some merges)")
        need(self.keep_checkpoints >= 1, "--keep-checkpoints", self.keep_checkpoints,
             "must be at least 1")
        if self.progressive is not None:
            need(self.progressive[0] < self.max_len, "--progressive", self.progressive[0],
                 f"the short length must be below --max-len {self.max_len}")

    @property
    def learning_rate(self) -> tuple[float, str]:
        """``(peak learning rate, why)``: ``--lr``, else from the weights' source (Note 1)."""
        if self.lr is not None:
            return self.lr, "--lr"
        if self.weights is not None:
            return PRETRAINED_LR, f"the fine-tuning default for pretrained weights ({self.weights})"
        if self.tiny:
            return RANDOM_TINY_LR, "random weights (no --weights): a from-scratch rate for the " \
                                   "tiny twin; pretrained weights take 2e-5"
        return RANDOM_LR, "random weights (no --weights): a from-scratch rate for a full-size " \
                          "model; pretrained weights take 2e-5"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        values = dict(values)
        if values.get("progressive") is not None:
            values["progressive"] = tuple(values["progressive"])
        return cls(**values)

    # what must match for a checkpoint to be resumed (the model and its shapes)
    def identity(self) -> dict:
        return {"model": self.model, "tiny": self.tiny, "weights": self.weights}
