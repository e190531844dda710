"""Real Hugging Face Trainer runs on CPU, and the measured steady-state optimizer step.

``tiny_trainer`` builds a Trainer the way users do (a tiny zoo model from its real config, a
dataset of plain per-sample lists, the Trainer's own default data collator, TrainingArguments);
``measure_trainer_step`` runs a real ``trainer.train()`` with a ``memfit.track`` opened at the
start of training (so every tensor the loop creates is counted from its birth) and reads the
peak over one whole later optimizer step: from ``on_step_begin`` of step ``step`` (its
micro-batches and the dataloader's look-ahead already fetched, as in every step) to its
``on_step_end`` (after clipping, the optimizer and scheduler steps and ``zero_grad``).
"""

from __future__ import annotations

import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

import memfit
from memfit import zoo

__all__ = ["tiny_trainer", "measure_trainer_step", "train_under", "StepWindow", "WholeRun",
           "dataset_of", "pad_every_row"]


def dataset_of(batch: dict[str, torch.Tensor]) -> list[dict]:
    """One dict of plain Python values per sample (what a tokenized ``datasets`` row is)."""
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i].tolist() for k, v in batch.items()} for i in range(n)]


def pad_every_row(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The last position of every row made padding (mask 0, label -100), so that every
    micro-batch, however shuffled, has a mask with zeros (``_hf_step`` Note 5)."""
    out = dict(batch)
    mask = out["attention_mask"].clone()
    mask[:, -1] = 0
    out["attention_mask"] = mask
    labels = out.get("labels")
    if labels is not None and labels.shape == mask.shape:
        out["labels"] = labels.masked_fill(mask == 0, -100)
    return out


def tiny_trainer(name: str = "gpt2", *, samples: int = 32, seq_len: int = 16, seed: int = 0,
                 padded: bool = True, output_dir: str | None = None, **args) -> Trainer:
    """A Trainer over a tiny ``name`` from the zoo and ``samples`` generated samples.

    ``args`` are TrainingArguments (defaults: batch 2, 3 steps, no logging, saving or reports).
    ``padded``: rows of several lengths (attention masks with zeros, as a padding collator
    makes them)."""
    spec = zoo.get(name)
    model = spec.build(tiny=True, seed=seed)
    text = spec.family != "vision"
    batch = spec.make_batch(model, samples, seq_len=seq_len if text else None,
                            padded=padded and text, seed=seed)
    if padded and text:
        batch = pad_every_row(batch)
    defaults = dict(per_device_train_batch_size=2, max_steps=3, report_to="none",
                    save_strategy="no", logging_strategy="no", use_cpu=True, seed=seed,
                    disable_tqdm=True, dataloader_num_workers=0)
    targs = TrainingArguments(output_dir or tempfile.mkdtemp(prefix="memfit-hf-"),
                              **(defaults | args))
    return Trainer(model=model, args=targs, train_dataset=dataset_of(batch))


class StepWindow(TrainerCallback):
    """Tracks the whole run from ``on_train_begin`` and keeps the figures of step ``step``
    (1-based), measured from its ``on_step_begin`` to its ``on_step_end``."""

    def __init__(self, step: int = 2, budget=None):
        self.step, self.budget = step, budget
        self.tracker = None
        self.peak_bytes = self.breakdown = self.measured = None
        self.losses: list[float] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        inner = getattr(optimizer, "optimizer", optimizer)       # accelerate's wrapper
        self.tracker = memfit.track(model, inner, budget=self.budget)
        self.tracker.__enter__()

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.step:
            self.tracker.start_window()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:       # the region ends with the window
            self.close()

    def on_train_end(self, args, state, control, **kw):
        self.close()

    def close(self):
        if self.tracker is not None:
            t, self.tracker = self.tracker, None
            t.__exit__(None, None, None)
            self.peak_bytes, self.breakdown = t.peak_bytes, t.breakdown
            self.measured = t          # the figures (a closed tracker holds no tensor)


class WholeRun(TrainerCallback):
    """A ``memfit.track(budget=...)`` around the whole of ``train()``, and the logged losses."""

    def __init__(self, budget=None):
        self.budget, self.tracker, self.losses = budget, None, []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.tracker = memfit.track(model, getattr(optimizer, "optimizer", optimizer),
                                    budget=self.budget)
        self.tracker.__enter__()

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])

    def on_train_end(self, args, state, control, **kw):
        self.close()

    def close(self):
        if self.tracker is not None:
            t, self.tracker = self.tracker, None
            t.__exit__(None, None, None)
            self.peak_bytes = t.peak_bytes


def train_under(trainer: Trainer, budget=None) -> WholeRun:
    """``trainer.train()`` under ``track(budget=...)`` from its first op to its last, logging
    the loss of every step (``logging_steps=1`` in the arguments). The RNG is seeded with
    ``args.seed`` first, so two runs shuffle and drop out alike whatever ran before."""
    run = WholeRun(budget)
    trainer.add_callback(run)
    try:
        set_seed(trainer.args.seed)
        trainer.train()
    finally:
        run.close()
        trainer.remove_callback(run)
    return run


def measure_trainer_step(trainer: Trainer, step: int = 2, budget=None) -> StepWindow:
    """Run ``trainer.train()`` and return the window of optimizer step ``step``."""
    if trainer.args.max_steps < step:
        raise ValueError(f"max_steps={trainer.args.max_steps} ends before step {step}")
    window = StepWindow(step, budget)
    trainer.add_callback(window)
    try:
        trainer.train()
    finally:
        window.close()
        trainer.remove_callback(window)
    return window
