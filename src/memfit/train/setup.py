"""Everything a run needs before its first step, checked in order from the cheapest check:
the run folder, the data, the tokenizer, the model (and, resuming, the checkpoint's identity),
then the plan and the Runner (``memfit.fit``) for the longest batch.

Note 1 (the longest batch). The plan is made for ``batch_size`` rows of the longest row in the data
(after ``max_len``), with one padded position in the attention mask so the trace takes the padded
attention path (a mask with zeros stays in the traced batch; an all-ones one is dropped): every real
batch has at most that many rows and tokens, so every one fits what was planned.

Note 2 (resume with another model). A checkpoint records the model's identity: zoo name, tiny
or not, weights folder, number of classes and vocabulary size. A resume that would build any
other model is refused before anything is loaded or written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from memfit.train import checkpoint as ckpt
from memfit.train.config import TrainConfig
from memfit.train.data import Table, load_table, split_holdout
from memfit.train.model import build_classifier, max_tokens
from memfit.train.tokenizer import Encoder, load_tokenizer, train_tokenizer

__all__ = ["Prepared", "prepare", "check_output"]


@dataclass
class Prepared:
    cfg: TrainConfig
    train: Table
    eval: Table
    eval_source: str
    encoder: Encoder
    train_ids: list[list[int]]
    eval_ids: list[list[int]]
    max_len: int
    runner: object                 # memfit.Runner
    predicted_peak_bytes: int | None
    budget_bytes: int | None
    device_name: str
    state: dict | None             # the checkpoint resumed from, else None
    identity: dict


def check_output(cfg: TrainConfig, resuming: bool) -> None:
    out = cfg.output
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--output {out}: that is a file; give a folder for the run")
    if not resuming and ckpt.list_checkpoints(out):
        raise ValueError(f"--output {out} already holds a run (checkpoints/); continue it with "
                         f"--resume {out}, or give another --output")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ValueError(f"--output {out}: cannot create a folder under {parent}; give "
                         "another --output")


def _tables(cfg: TrainConfig) -> tuple[Table, Table, str]:
    train = load_table(cfg.data, cfg.text_column, cfg.label_column)
    if cfg.eval_data is not None:
        held = load_table(cfg.eval_data, cfg.text_column, cfg.label_column, flag="--eval-data",
                          num_labels=train.num_labels)
        return train, held, cfg.eval_data
    train, held = split_holdout(train, cfg.eval_fraction, cfg.seed)
    return train, held, f"{len(held.labels)} rows held out of {cfg.data}"


def _encoder(cfg: TrainConfig, train: Table, resuming: bool, say) -> Encoder:
    saved = os.path.join(cfg.output, "tokenizer.json")
    if cfg.tokenizer is not None:
        return load_tokenizer(cfg.tokenizer)
    if resuming and os.path.isfile(saved):
        enc = load_tokenizer(saved)
        enc.source = "trained on the data"
        return enc
    import time

    start = time.perf_counter()
    enc = train_tokenizer(train.texts, cfg.vocab_size)
    say(f"no --tokenizer: trained a byte-level BPE tokenizer on the {len(train.texts)} training "
        f"texts ({enc.vocab_size} tokens) in {time.perf_counter() - start:.1f} s; saved in the "
        "run folder")
    return enc


def prepare(cfg: TrainConfig, *, resume: str | None = None, say=print) -> Prepared:
    check_output(cfg, resume is not None)
    state = None
    if resume is not None:
        state = ckpt.load(ckpt.resolve(resume))          # corrupt: refused here (checked)
    train, held, eval_source = _tables(cfg)
    encoder = _encoder(cfg, train, resume is not None, say)
    identity = {**cfg.identity(), "num_labels": train.num_labels,
                "vocab_size": encoder.vocab_size}
    if state is not None and state["identity"] != identity:
        theirs = state["identity"]
        diff = ", ".join(f"{k} {theirs.get(k)!r} -> {identity.get(k)!r}" for k in identity
                         if theirs.get(k) != identity.get(k))
        raise ValueError(f"--resume {resume}: the checkpoint is of another model ({diff}); "
                         "resume with the run's own --model/--tiny/--weights/data, or start a "
                         "new run with another --output")
    torch.manual_seed(cfg.seed)
    model = build_classifier(cfg.model, num_labels=train.num_labels, encoder=encoder,
                             tiny=cfg.tiny, weights=cfg.weights, device=cfg.device, seed=cfg.seed)
    limit = max_tokens(model)
    max_len = cfg.max_len if limit is None else min(cfg.max_len, limit)
    if limit is not None and cfg.max_len > limit:
        say(f"--max-len {cfg.max_len} is more than the model takes: rows are cut at {limit} "
            "tokens")
    if cfg.progressive is not None and cfg.progressive[0] >= max_len:
        raise ValueError(f"--progressive {cfg.progressive[0]}: the short length must be below "
                         f"the full length {max_len}")
    train_ids = encoder.encode(train.texts, max_len)
    eval_ids = encoder.encode(held.texts, max_len)
    if state is not None:
        model.load_state_dict(state["model"])
    runner, predicted, budget, device_name = _runner(cfg, model, train_ids, encoder, say)
    if state is not None:
        runner.optimizer.load_state_dict(state["optimizer"])
        runner.scheduler.load_state_dict(state["scheduler"])
        if runner.scaler is not None and state.get("scaler") is not None:
            runner.scaler.load_state_dict(state["scaler"])
    os.makedirs(cfg.output, exist_ok=True)
    if cfg.tokenizer is None:
        encoder.save(cfg.output)
    return Prepared(cfg, train, held, eval_source, encoder, train_ids, eval_ids, max_len, runner,
                    predicted, budget, device_name, state, identity)


def example_batch(ids: list[list[int]], batch_size: int, pad_id: int) -> dict:
    """The longest batch (Note 1)."""
    length = max(len(x) for x in ids)
    rows = min(batch_size, len(ids))
    mask = torch.ones((rows, length), dtype=torch.long)
    mask[-1, -1] = 0
    input_ids = torch.full((rows, length), 5, dtype=torch.long)
    input_ids[-1, -1] = pad_id
    return {"input_ids": input_ids, "attention_mask": mask,
            "labels": torch.zeros(rows, dtype=torch.long)}


def total_steps(cfg: TrainConfig, rows: int) -> int:
    import math

    per_epoch = math.ceil(rows / cfg.batch_size)
    steps = max(1, math.ceil(cfg.epochs * per_epoch))
    return min(steps, cfg.max_steps) if cfg.max_steps is not None else steps


def _runner(cfg: TrainConfig, model, ids, encoder, say):
    """``memfit.fit`` for the longest batch under the budget (Note 1), with AdamW and a linear
    warm-up then linear decay of the learning rate."""
    from memfit.api.fit import fit
    from memfit.api._setup import resolve_device

    spec = resolve_device(model, cfg.gpu)      # --gpu, else where the model is
    steps = total_steps(cfg, len(ids))
    warm = max(1, round(cfg.warmup_fraction * steps)) if cfg.warmup_fraction > 0 else 0

    def schedule(opt):
        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return max(0.0, (steps - step) / max(1, steps - warm))
        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    if spec.kind == "cuda" and cfg.device != "cuda":
        say(f"note: planning for the {spec.display_name} (--gpu) but training on the CPU (this "
            "torch sees no GPU): the measured memory is CPU live bytes, not that GPU's")
    lr, why = cfg.learning_rate          # follows the weights: pretrained or from scratch
    say(f"learning rate {lr:g} ({why})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    example = example_batch(ids, cfg.batch_size, encoder.pad_id)
    budget = cfg.budget_bytes if cfg.budget_bytes is not None else spec.usable_bytes
    say(f"planning for the longest batch ({example['input_ids'].shape[0]} x "
        f"{example['input_ids'].shape[1]} tokens) on {spec.display_name}...")
    runner = fit(model, optimizer, example, budget=budget, device=spec, scheduler=schedule,
                 precision=cfg.precision, max_grad_norm=cfg.max_grad_norm)
    return runner, runner.plan.predicted_peak_bytes, budget, spec.display_name


def write_run_files(p: Prepared) -> None:
    """config.json (resolved) and plan.json in the run folder."""
    cfg = p.cfg
    resolved = json.loads(cfg.to_json())
    resolved.update(resolved_max_len=p.max_len, lr_resolved=cfg.learning_rate[0],
                    num_labels=p.train.num_labels,
                    tokenizer_source=p.encoder.source,
                    tokenizer_vocab_size=p.encoder.vocab_size,
                    train_rows=len(p.train.labels), eval_rows=len(p.eval.labels),
                    eval_source=p.eval_source, budget_bytes_resolved=p.budget_bytes,
                    planned_on=p.device_name)
    for name, text in (("config.json", json.dumps(resolved, indent=2)),
                       ("plan.json", p.runner.plan.to_json())):
        tmp = os.path.join(cfg.output, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, os.path.join(cfg.output, name))
