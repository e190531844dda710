"""memfit's estimate beside the CPU allocator's own count of the real step, zoo model by zoo
model, in one run: an oracle that is not memfit's and no dispatch mode (a mode turns autograd's
in-place gradient sums off; docs/measurement.md).

    python benchmarks/allocator_oracle.py [--models bert-base,gpt2,...]

Each real step runs in a fresh process: a tiny config with random weights, batch 2, AdamW,
memfit's plain loop (``canonical_step``) three times inside ``torch.profiler(profile_memory=
True)``, the model and batch built inside the profile so every live byte is one the profiler
saw allocated; the third step's peak (``tests/trace/_compiled_oracle.allocator_peak``).
memfit's estimate (CPU target) of the same model and batch is made in that process too. Nothing
here is a GPU measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import _record  # noqa: E402

MODELS = ("bert-base", "gpt2", "llama-1b", "t5-base", "whisper-small", "deberta-v3-base",
          "modernbert-base", "clip-vit-base-patch32", "swin-tiny", "gemma-2-2b")


def one(name: str) -> dict:
    """The real step's peak and memfit's estimate of ``name`` (run in a fresh process)."""
    import memfit
    from memfit import zoo
    from memfit.step import canonical_step, prepare_batch
    from tests.trace._compiled_oracle import last_step_peak

    spec = zoo.get(name)

    def build():
        torch.manual_seed(0)
        model = spec.build(tiny=True, device="cpu")
        return model, prepare_batch(spec.make_batch(model, 2))

    def make():
        model, batch = build()
        return model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4)

    measured = last_step_peak(make, lambda m, b, o: canonical_step(m, o, b))
    model, batch = build()
    est = memfit.estimate(memfit.Job(model, batch), device="cpu")
    return {"model": name, "measured_bytes": measured, "memfit_bytes": est.peak_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated zoo names (default: %(default)s)")
    ap.add_argument("--one", help=argparse.SUPPRESS)     # the fresh process's own job
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    console = Console()
    table = Table(title="memfit's estimate vs the CPU allocator's real step (bytes, tiny configs)")
    for col in ("model", "measured", "memfit", "error"):
        table.add_column(col)
    rows = []
    for name in args.models.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                             text=True, timeout=900)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            console.print(f"{name}: failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        row = json.loads(lines[-1])
        row["error_pct"] = round(100 * (row["memfit_bytes"] - row["measured_bytes"])
                                 / row["measured_bytes"], 4)
        rows.append(row)
        table.add_row(name, f"{row['measured_bytes']:,}", f"{row['memfit_bytes']:,}",
                      f"{row['error_pct']:+.4f}%")
    console.print(table)
    path = _record.write("allocator_oracle", {"batch": 2, "optimizer": "adamw",
                                              "threads": torch.get_num_threads()}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
