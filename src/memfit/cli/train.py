"""``memfit train``: fine-tune a sequence classifier on a CSV/JSONL file within the memory you have.

Flags left unset take ``memfit.train.TrainConfig``'s defaults, or, with ``--resume``, the
values the run was started with (its ``config.json``); a flag given with ``--resume`` replaces
the saved value (a different model is refused: its checkpoint would not load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from memfit.cli._args import budget_bytes, positive_float, positive_int, progressive_spec
from memfit.knobs import PRECISIONS

__all__ = ["add_parser", "run"]


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 1)")
    return v


def _report_path(text: str) -> str:
    from memfit.cli._report_args import _html_path
    return _html_path(text)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="fine-tune a text classifier on a CSV/JSONL file within the memory budget",
        description="Fine-tune a Hugging Face sequence classifier (a built-in model) on a CSV or "
                    "JSONL file: the step is planned by `memfit plan` for the longest batch and "
                    "run with the plan (AMP and loss scaling, accumulation, recompute/offload, "
                    "the OOM guard). Writes a run folder: config.json, plan.json, metrics.jsonl, "
                    "checkpoints, loss.png and memory.png. Needs pip install 'memfit[train]'.")
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="FILE", help="training file: .csv, .tsv, .jsonl or .json")
    g.add_argument("--text-column", metavar="NAME", help="column with the text (default: "
                   "comment_text)")
    g.add_argument("--label-column", metavar="NAME", help="column with the labels, 0/1 or "
                   "class ids 0..K-1 (default: toxic)")
    g.add_argument("--eval-data", metavar="FILE", help="evaluation file with the same columns "
                   "(default: hold out --eval-fraction of --data)")
    g.add_argument("--eval-fraction", type=positive_float, metavar="F",
                   help="fraction of --data held out for evaluation without --eval-data "
                        "(default: 0.1)")
    g.add_argument("--max-len", type=positive_int, metavar="N",
                   help="tokens per row at most, <s> and </s> included (default: 256, or the "
                        "model's limit if lower)")
    g.add_argument("--make-demo-data", metavar="FILE.csv",
                   help="write a synthetic multilingual toxic-comment CSV (columns id, "
                        "comment_text, lang, toxic; a learnable rule) and exit")
    g.add_argument("--rows", type=positive_int, default=2000,
                   help="rows of --make-demo-data (default: 2000)")
    g = p.add_argument_group("model and tokenizer")
    g.add_argument("--model", metavar="NAME", help="a built-in model (default: "
                   "xlm-roberta-large); `memfit models` lists them")
    g.add_argument("--tiny", action="store_true", default=None,
                   help="the model's tiny twin (2 layers, width 64; for demos and tests), its "
                        "vocabulary sized to the tokenizer")
    g.add_argument("--weights", metavar="DIR", help="a local from_pretrained folder (default: "
                   "random weights from the model's config)")
    g.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer folder or "
                   "tokenizer.json (default: train a byte-level BPE on --data, in seconds)")
    g.add_argument("--vocab-size", type=positive_int, metavar="N",
                   help="vocabulary of the tokenizer trained on the data (default: 8000)")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=positive_int, metavar="N",
                   help="samples per optimizer step, the effective batch; memfit picks the "
                        "micro-batch (default: 32)")
    g.add_argument("--epochs", type=positive_float, metavar="E", help="passes over the "
                   "data (default: 1)")
    g.add_argument("--max-steps", type=positive_int, metavar="N",
                   help="stop after N steps if the epochs have not ended (default: none)")
    g.add_argument("--lr", type=positive_float, metavar="LR", help="peak learning rate of "
                   "AdamW (default: from the weights: 2e-5 with --weights, pretrained; 1e-3 "
                   "for --tiny and 3e-4 for a full-size model with random weights, trained "
                   "from scratch; the run says which it took)")
    g.add_argument("--weight-decay", type=float, metavar="W", help="AdamW weight decay "
                   "(default: 0.01)")
    g.add_argument("--warmup", type=_fraction, metavar="F",
                   help="fraction of the steps with a linear warm-up, then linear decay to 0 "
                        "(default: 0.1)")
    g.add_argument("--max-grad-norm", type=positive_float, metavar="X",
                   help="clip the gradient norm at X (default: 1.0)")
    g.add_argument("--precision", choices=PRECISIONS,
                   help="numerics (default: auto: 16-bit autocast on a GPU, fp32 on the CPU)")
    g.add_argument("--progressive", type=progressive_spec, metavar="LEN[:FRACTION]",
                   help="the seed's progressive length: FRACTION of the steps (default 0.9) "
                        "with rows cut to LEN tokens, the rest at full length")
    g.add_argument("--seed", type=int, help="seed of the weights, the split and the order "
                   "(default: 0)")
    g = p.add_argument_group("memory")
    g.add_argument("--budget", type=budget_bytes, metavar="BYTES",
                   help="device bytes to fit, e.g. 11GiB (default: the device's usable memory)")
    g.add_argument("--gpu", metavar="NAME", help="plan for this GPU of `memfit gpus` "
                   "(default: the machine's GPU if there is one, else the CPU)")
    g = p.add_argument_group("run folder")
    g.add_argument("--output", metavar="DIR", help="the run folder (default: "
                   "runs/train-DATE-TIME)")
    g.add_argument("--resume", metavar="DIR", help="continue a run from its latest checkpoint "
                   "(a run folder) or from one checkpoint folder")
    g.add_argument("--eval-every", type=positive_int, metavar="N",
                   help="evaluate every N steps (default: at the end)")
    g.add_argument("--save-every", type=positive_int, metavar="N",
                   help="checkpoint every N steps (default: at the end; Ctrl-C also saves)")
    g.add_argument("--keep-checkpoints", type=positive_int, metavar="N",
                   help="checkpoints kept, newest first (default: 2)")
    g.add_argument("--report", default=None, metavar="FILE.html", type=_report_path,
                   help="also write an HTML report of the run (one self-contained file): each "
                        "step's measured peak beside the plan's prediction and the budget, the "
                        "plan's per-block table (needs plotly: pip install 'memfit[report]')")
    g.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(run=run)
    return p


_FLAG_FIELDS = {"data": "data", "text_column": "text_column", "label_column": "label_column",
                "eval_data": "eval_data", "eval_fraction": "eval_fraction", "max_len": "max_len",
                "model": "model", "tiny": "tiny", "weights": "weights", "tokenizer": "tokenizer",
                "vocab_size": "vocab_size", "batch_size": "batch_size", "epochs": "epochs",
                "max_steps": "max_steps", "lr": "lr", "weight_decay": "weight_decay",
                "warmup": "warmup_fraction", "max_grad_norm": "max_grad_norm",
                "precision": "precision", "progressive": "progressive", "seed": "seed",
                "budget": "budget_bytes", "gpu": "gpu", "output": "output",
                "eval_every": "eval_every", "save_every": "save_every",
                "keep_checkpoints": "keep_checkpoints"}


def config_from_args(args):
    """The TrainConfig of the flags (module docstring)."""
    from memfit.train.config import TrainConfig

    values: dict = {}
    if args.resume is not None:
        saved = os.path.join(args.resume, "config.json")
        if not os.path.isfile(saved):      # a checkpoint folder: its run is two levels up
            saved = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.resume))),
                                 "config.json")
        if not os.path.exists(args.resume):
            raise FileNotFoundError(f"--resume {args.resume}: no such folder")
        if not os.path.isfile(saved):
            raise ValueError(f"--resume {args.resume}: not a memfit train run folder (no "
                             "config.json)")
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        with open(saved) as f:
            values = {k: v for k, v in json.load(f).items() if k in fields}
        run_folder = os.path.dirname(saved)
        if args.output is not None and os.path.abspath(args.output) != os.path.abspath(run_folder):
            raise ValueError(f"--output {args.output} with --resume: a resumed run continues in "
                             f"its own folder ({run_folder}); leave --output out, or copy the "
                             "run folder first")
        values["output"] = run_folder      # the folder resumed, wherever it was first written
    for flag, field in _FLAG_FIELDS.items():
        v = getattr(args, flag)
        if v is not None:
            values[field] = v
    if values.get("data") is None:
        raise ValueError("--data FILE is needed: the training file (.csv or .jsonl); try "
                         "`memfit train --make-demo-data demo.csv` for a small one")
    values.setdefault("output", os.path.join("runs", time.strftime("train-%Y%m%d-%H%M%S")))
    import torch

    values.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    if "max_len" not in values:
        values["max_len"] = 256
    return TrainConfig.from_dict(values)


def run(args) -> int:
    if args.make_demo_data:
        from memfit.train.synthetic import make_toxic_csv

        path = make_toxic_csv(args.make_demo_data, args.rows)
        print(f"wrote {args.rows} rows to {path} (columns id, comment_text, lang, toxic)")
        return 0
    cfg = config_from_args(args)
    if args.report:
        from memfit.cli._report_args import check
        args.snapshot, args.snapshot_at = None, "end"      # train has --report only
        check(args)
    from rich.console import Console

    from memfit.train.loop import train
    from memfit.train.progress import Bar

    console = Console(stderr=args.json)

    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    say(f"memfit train: {cfg.model}{' (tiny)' if cfg.tiny else ''} on {cfg.data}, batch "
        f"{cfg.batch_size}, run folder {cfg.output}")
    result = train(cfg, resume=args.resume, say=say, progress=Bar(console))
    out = {"folder": result.folder, "steps": result.steps, "interrupted": result.interrupted,
           "last_loss": result.last_loss, "eval": result.eval, "checkpoint": result.checkpoint,
           "measured_peak_bytes": result.peak_bytes,
           "predicted_peak_bytes": result.predicted_peak_bytes,
           "lr": cfg.learning_rate[0], "lr_source": cfg.learning_rate[1]}
    if args.report:
        out["report"] = _write_report(args.report, result.folder, cfg)
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        from memfit.units import format_bytes

        if result.peak_bytes is not None and result.predicted_peak_bytes:
            say(f"memory: measured peak {format_bytes(result.peak_bytes)}, predicted for the "
                f"longest batch {format_bytes(result.predicted_peak_bytes)}")
        say(f"{'stopped' if result.interrupted else 'done'} after {result.steps} steps; last "
            f"checkpoint {result.checkpoint}; metrics, plan and plots in {result.folder}")
        if result.interrupted:
            say(f"continue with: memfit train --resume {result.folder}")
        if args.report:
            say(f"report written to {args.report}")
    return 130 if result.interrupted else 0


def _write_report(path: str, folder: str, cfg) -> str:
    """The run's HTML report (``memfit.report.html_run``) from its metrics and plan files."""
    from memfit.planner import Plan
    from memfit.report.html_run import write_run_report
    from memfit.train.metrics import MetricsLog

    with open(os.path.join(folder, "plan.json")) as f:
        plan = Plan.from_json(f.read())
    records = MetricsLog(os.path.join(folder, "metrics.jsonl")).read()
    title = f"memfit train: {cfg.model}{' (tiny)' if cfg.tiny else ''}, batch {cfg.batch_size}"
    return write_run_report(path, records, plan, title=title)
