"""One shared trace (symbolic batch and length) vs one trace per row, side by side in one run.

    python benchmarks/shared_trace.py [--quick] [--gpu rtx-6000] [--models a,b]

Per group of the seed's table (one model, precision, checkpointing; every batch size x length):
the CPU seconds of one trace per row (``memfit.estimate``, what ``memfit bench seed`` did before)
and of one shared trace replayed per row (``memfit.api._shared_shapes.estimate_shapes``), the
ratio, and whether every row's figures are equal (they must be: the per-row traces are the
oracle). The two ways alternate group by group, in both orders, on one torch thread; CPU time
(``time.process_time``) is the figure, as the machine is shared. Predicted only (no GPU ran).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from rich.console import Console
from rich.table import Table

import _record
import memfit
from memfit import zoo
from memfit.api._shared_shapes import estimate_shapes
from memfit.trace.allocator import AllocatorConfig

FIGURES = ("peak_bytes", "reserved_bytes", "device_bytes")


def group(name: str, precision: str, checkpoint: str | None, shapes, gpu: str, tiny: bool,
          shared_first: bool) -> dict:
    spec = zoo.get(name)
    model = spec.build(None, tiny=tiny, device="meta")
    make = lambda s: spec.make_batch(model, s["batch"], seq_len=s["seq"], image_size=None,
                                     padded=False, task=None)
    kwargs = dict(precision=precision, checkpoint=checkpoint,
                  allocator=AllocatorConfig(expandable_segments=False))

    def per_row():
        return [memfit.estimate(model, make(s), optimizer="adamw", device=gpu, **kwargs)
                for s in shapes]

    def shared():
        return estimate_shapes(model, make, shapes, "adamw", gpu, **kwargs)
    timed = {}
    for way in (("shared", shared), ("per_row", per_row))[::1 if shared_first else -1]:
        start = time.process_time()
        timed[way[0]] = (way[1](), time.process_time() - start)
    (alone, alone_s), (one, one_s) = timed["per_row"], timed["shared"]
    equal = all(getattr(a, k) == getattr(b, k) for a, b in zip(alone, one) for k in FIGURES)
    return {"model": name, "precision": precision, "checkpoint": checkpoint or "none",
            "rows": len(shapes), "shared_rows": sum(g.shared for g in one),
            "per_row_cpu_s": round(alone_s, 2), "shared_cpu_s": round(one_s, 2),
            "speedup": round(alone_s / one_s, 2), "equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, two groups")
    ap.add_argument("--gpu", default="rtx-6000", help="GPU of `memfit gpus` (default rtx-6000)")
    ap.add_argument("--models", default="xlm-roberta-base,xlm-roberta-large",
                    help="comma-separated zoo models (default: the seed's two)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.quick:
        models, shapes = ["xlm-roberta-base"], [{"batch": b, "seq": s} for s in (32, 64)
                                                for b in (4, 8)]
    else:
        models = args.models.split(",")
        shapes = [{"batch": b, "seq": s} for s in (128, 256, 512) for b in (8, 16, 32)]
    groups = list(itertools.product(models, ("fp32", "fp16"), (None, "all")))
    if args.quick:
        groups = groups[1:3]
    console = Console(width=None if sys.stdout.isatty() else 120)
    rows = []
    for i, (name, precision, checkpoint) in enumerate(groups):
        with console.status(f"{name} {precision} checkpoint={checkpoint} ({i + 1}/{len(groups)})"):
            rows.append(group(name, precision, checkpoint, shapes, args.gpu, args.quick,
                              shared_first=i % 2 == 0))
    t = Table(title=f"one shared trace vs one trace per row, {args.gpu} (CPU seconds)")
    for col in ("model", "precision", "checkpoint", "rows", "shared", "per row s", "shared s",
                "speedup", "equal"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["model"], r["precision"], r["checkpoint"], str(r["rows"]),
                  str(r["shared_rows"]), f"{r['per_row_cpu_s']:.1f}", f"{r['shared_cpu_s']:.1f}",
                  f"{r['speedup']:.2f}x", "yes" if r["equal"] else "[red]NO[/red]")
    console.print(t)
    total = sum(r["per_row_cpu_s"] for r in rows) / sum(r["shared_cpu_s"] for r in rows)
    console.print(f"overall {total:.2f}x less CPU; every row equal: "
                  f"{all(r['equal'] for r in rows)}")
    path = _record.write("shared_trace" + ("-quick" if args.quick else ""),
                         {"gpu": args.gpu, "models": models, "shapes": shapes,
                          "quick": args.quick, "torch_threads": 1}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
