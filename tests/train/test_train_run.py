"""``memfit.train`` on the generated toxic-comment CSV with the tiny XLM-R: it learns, its run
folder is complete, a run stopped by Ctrl-C at step k and resumed equals the uninterrupted run
bit for bit, and under a CPU budget below the plain step's peak it stays inside
``memfit.track(budget=...)`` (the oracle: track raises memfit.OutOfMemory past the budget)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

import memfit
from memfit.train import train
from memfit.train import checkpoint as ckpt

from tests.train.conftest import STEPS, config, quiet


def records(folder: str, kind: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_learns_the_rule_and_writes_the_run_folder(full_run):
    cfg, result = full_run
    assert result.steps == STEPS and not result.interrupted
    losses = [r["loss"] for r in records(cfg.output, "train")]
    assert len(losses) == STEPS
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.05       # the loss falls
    evals = records(cfg.output, "eval")
    assert [e["step"] for e in evals] == [12, STEPS]
    assert evals[-1]["eval_auc"] > 0.65                  # chance is 0.5 (synthetic Note 1)
    assert 0 <= evals[-1]["eval_accuracy"] <= 1 and evals[-1]["eval_rows"] == 40
    for name in ("config.json", "plan.json", "metrics.jsonl", "loss.png", "memory.png"):
        assert os.path.getsize(os.path.join(cfg.output, name)) > 0, name
    memfit.Plan.from_json(open(os.path.join(cfg.output, "plan.json")).read())
    kept = [os.path.basename(c) for c in ckpt.list_checkpoints(cfg.output)]
    assert kept == ["step-0000016", "step-0000024"]           # keep_checkpoints=2
    lr = [r["lr"] for r in records(cfg.output, "train")]
    assert lr[0] < lr[1] < lr[2] and lr[-1] < max(lr)        # warm-up, then decay
    # measured on the CPU with track: the longest batch was planned, every batch fits it
    assert 0 < result.peak_bytes <= result.predicted_peak_bytes


@pytest.mark.slow
def test_ctrl_c_then_resume_equals_uninterrupted_bitwise(full_run, toxic_csv, tokenizer_file,
                                                          tmp_path):
    cfg_full, _ = full_run
    cfg = config(toxic_csv, tokenizer_file, tmp_path / "stopped")

    def ctrl_c(step, record):
        if step == 10:                    # a real SIGINT, as the terminal sends it
            os.kill(os.getpid(), signal.SIGINT)
    first = train(cfg, say=quiet, on_step=ctrl_c)
    assert first.interrupted and first.steps == 10
    assert os.path.basename(first.checkpoint) == "step-0000010"
    second = train(cfg, resume=cfg.output, say=quiet)
    assert second.steps == STEPS and not second.interrupted
    a = ckpt.load(ckpt.latest(cfg_full.output))
    b = ckpt.load(ckpt.latest(cfg.output))
    assert a["model"].keys() == b["model"].keys()
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for pa, pb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert [r["loss"] for r in records(cfg.output, "train")] == \
        [r["loss"] for r in records(cfg_full.output, "train")]


@pytest.mark.slow       # a searched plan: ~1 min on a loaded 2-core machine
def test_stays_under_a_cpu_budget_below_the_plain_peak(full_run, toxic_csv, tokenizer_file,
                                                        tmp_path):
    _, plain = full_run                       # its plan: the plain step fits, unchanged
    budget = int(plain.predicted_peak_bytes * 0.85)
    cfg = config(toxic_csv, tokenizer_file, tmp_path / "budget", budget_bytes=budget,
                 max_steps=4, save_every=None, eval_every=None, measure_steps=0)
    with memfit.track(budget=budget) as t:    # raises memfit.OutOfMemory past the budget
        result = train(cfg, say=quiet)
    assert result.steps == 4
    assert t.peak_bytes <= budget < plain.predicted_peak_bytes
    planned = memfit.Plan.from_json(open(os.path.join(cfg.output, "plan.json")).read())
    changed = planned.knobs.micro_batch_size not in (None, 16) or \
        planned.knobs.offload_optimizer or any(m != "keep" for m in planned.blocks.values())
    assert changed, planned.explain()


def _marker_csv(path, rows: int = 400, seed: int = 0) -> str:
    """A CSV no test tuned for: 8 common words a row, label 1 exactly when one of them is
    replaced by "zebra" (every row the same length, half of them labelled 1)."""
    import csv
    import random

    rng = random.Random(seed)
    words = ("river stone cloud paper lamp garden window music table forest bread candle "
             "mirror bottle ladder pencil basket wheel").split()
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["comment_text", "toxic"])
        for _ in range(rows):
            row = [rng.choice(words) for _ in range(8)]
            label = int(rng.random() < 0.5)
            if label:
                row[rng.randrange(8)] = "zebra"
            out.writerow([" ".join(row), label])
    return str(path)


def test_random_weights_default_to_a_from_scratch_learning_rate(tmp_path):
    """Issue 26 item 17: without --lr or --weights the tiny model starts from random weights;
    in 3 epochs on a CSV it never saw it must learn the rule. The old default for every run
    (2e-5, a fine-tuning rate) leaves it at AUC 0.69 here, 1e-3 reaches 1.0. The oracle is the
    held-out AUC of the real run on 100 rows."""
    import dataclasses

    from memfit.train import TrainConfig
    from memfit.train.data import load_table
    from memfit.train.tokenizer import train_tokenizer

    data = _marker_csv(tmp_path / "marker.csv")
    tok = str(tmp_path / "tokenizer.json")
    train_tokenizer(load_table(data, "comment_text", "toxic").texts, 1000).backend.save(tok)
    values = dataclasses.asdict(config(data, tok, tmp_path / "run", max_steps=None,
                                       eval_every=None, save_every=None, eval_fraction=0.25))
    del values["lr"]                                   # the default, whatever it is
    cfg = TrainConfig.from_dict(values)
    said = []
    train(cfg, say=said.append)
    assert any(line.startswith("learning rate 0.001 (random weights") for line in said), said
    assert max(r["lr"] for r in records(cfg.output, "train")) == pytest.approx(1e-3)
    last = records(cfg.output, "eval")[-1]
    assert last["eval_rows"] == 100 and last["eval_auc"] > 0.95, last
    with open(os.path.join(cfg.output, "config.json")) as f:
        assert json.load(f)["lr_resolved"] == 1e-3
    assert dataclasses.replace(cfg, weights="some/folder").learning_rate[0] == 2e-5
    assert dataclasses.replace(cfg, tiny=False).learning_rate[0] == 3e-4
    assert dataclasses.replace(cfg, lr=5e-5).learning_rate == (5e-5, "--lr")
