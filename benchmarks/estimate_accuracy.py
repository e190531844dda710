"""Predicted (estimate, fake trace) vs measured (track, real CPU step) bytes, and the time each
takes, per architecture; side by side in one run. The full-size XLM-R-large step (batch 8,
length 256, AdamW, fp32) is measured for real too unless --quick.

    python benchmarks/estimate_accuracy.py [--quick] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402
from memfit.optimizers import OptimizerRecipe  # noqa: E402
from memfit.step import canonical_step, prepare_batch  # noqa: E402
from memfit.techniques.precision import Precision  # noqa: E402

import _record  # noqa: E402

# (model, tiny?, batch, seq_len or image size, padded)
CASES = [
    ("bert-base", True, 8, 64, True), ("roberta-base", True, 8, 64, False),
    ("xlm-roberta-base", True, 8, 64, True), ("gpt2", True, 8, 64, True),
    ("llama-1b", True, 8, 64, True), ("t5-base", True, 8, 64, False),
    ("vit-base", True, 8, None, False), ("resnet-50", True, 8, None, False),
    ("gpt2", False, 2, 128, False), ("bert-base", False, 4, 128, False),
    ("xlm-roberta-large", False, 8, 256, False),
]


def measure(model, batch, optimizer: str, precision: str):
    tech = Precision(Precision.Config(precision))
    opt = tech.apply(model, OptimizerRecipe(optimizer)).optimizer
    batch = tech.prepare_batch(prepare_batch(batch))
    canonical_step(model, opt, batch, None, tech.autocast("cpu"))
    start = time.perf_counter()
    with memfit.track(model, opt) as t:
        canonical_step(model, opt, batch, None, tech.autocast("cpu"))
    return t, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the full-size XLM-R-large real step")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "bf16-pure"],
                    help="numerics of every step (default: fp32)")
    ap.add_argument("--optimizer", default="adamw", help="optimizer (default: adamw)")
    args = ap.parse_args()
    console = Console(width=150)
    table = Table(title=f"estimate vs track, {args.precision}, {args.optimizer}")
    for col in ("model", "size", "batch", "predicted", "measured", "diff B", "estimate s",
                "real step s", "real/estimate"):
        table.add_column(col, justify="right" if col not in ("model", "size") else "left")
    rows = []
    for name, small, bs, length, padded in CASES:
        if args.quick and name == "xlm-roberta-large":
            continue
        spec = zoo.get(name)
        with console.status(f"{name} ({'tiny' if small else 'full'}): building"):
            torch.manual_seed(0)
            model = spec.build(tiny=small, seed=0)
            vision = spec.family == "vision"
            batch = spec.make_batch(model, bs, seq_len=None if vision else length,
                                    padded=padded and not vision)
        with console.status(f"{name}: estimating"):
            start = time.perf_counter()
            est = memfit.estimate(model, batch, optimizer=args.optimizer, device="cpu",
                                  precision=args.precision)
            est_s = time.perf_counter() - start
        with console.status(f"{name}: running and measuring two real steps"):
            t, real_s = measure(model, batch, args.optimizer, args.precision)
        del model
        shape = "x".join(map(str, batch.get("input_ids", batch.get("pixel_values")).shape))
        row = {"model": name, "size": "tiny" if small else "full", "batch": shape,
               "padded": padded, "predicted_peak_bytes": est.peak_bytes,
               "measured_peak_bytes": t.peak_bytes, "breakdown_equal": est.breakdown == t.breakdown,
               "estimate_seconds": round(est_s, 3), "trace_seconds": round(est.trace_seconds, 3),
               "real_step_seconds": round(real_s, 3)}
        rows.append(row)
        table.add_row(name, row["size"], shape, memfit.format_bytes(est.peak_bytes),
                      memfit.format_bytes(t.peak_bytes), str(est.peak_bytes - t.peak_bytes),
                      f"{est_s:.2f}", f"{real_s:.2f}", f"{real_s / est_s:.1f}x")
    console.print(table)
    path = _record.write(f"estimate_accuracy-{args.precision}",
                         {"precision": args.precision, "optimizer": args.optimizer,
                          "cases": CASES, "quick": args.quick}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
