"""torch.compile's ``activation_memory_budget`` sweep: the real compiled CPU step beside memfit's
estimate of it, budget by budget, in one run.

    python benchmarks/compiled_budget.py [--model llama-1b] [--compile blocks] [--quick]

For each budget (1.0, the default, down to 0.0) a fresh process compiles the model (tiny
config, random weights) with Inductor, as ``memfit estimate --compile`` does, runs the plain
loop and reports the third step's peak live CPU bytes, from the CPU allocator's own events
(``torch.profiler``, tests/trace/_compiled_oracle.py), and the median wall time of five more
steps. memfit's estimate of the same step (``--activation-memory-budget``) is printed beside
it, with its error. The budget trades activation memory for recompute: the rows show what
each setting holds and costs, and whether memfit's answer follows it.

Nothing here is a GPU measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import _record  # noqa: E402
from tests.trace._compiled_oracle import estimated  # noqa: E402

BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.0)

_TIMED = """
import json, statistics, sys, time, torch
from tests.trace._compiled_oracle import budget, build, compile_as, measured_peak
job = json.loads(sys.argv[1])
peak = measured_peak(job)
with budget(job):
    _, model, batch = build(job)
    run = compile_as(model, job["compile"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(8):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        run(**batch).loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
print(json.dumps({"peak": peak, "step_s": statistics.median(times[3:])}))
"""


def real_step(job: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _TIMED, json.dumps(job)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1b", help="a zoo model, built tiny")
    ap.add_argument("--compile", default="blocks", choices=("model", "blocks"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="budgets 1.0 and 0.0 only")
    args = ap.parse_args()
    console = Console()
    rows = []
    for b in (1.0, 0.0) if args.quick else BUDGETS:
        job = {"model": args.model, "batch": args.batch, "seq_len": args.seq_len,
               "compile": args.compile, "use_cache": False, "activation_memory_budget": b}
        t = time.perf_counter()
        est = estimated(job).peak_bytes
        est_s = time.perf_counter() - t
        real = real_step(job)
        rows.append({"budget": b, "measured_peak_bytes": real["peak"],
                     "memfit_peak_bytes": est,
                     "error_pct": round(100 * (est - real["peak"]) / real["peak"], 3),
                     "step_ms": round(1000 * real["step_s"], 2),
                     "memfit_estimate_s": round(est_s, 1)})
        console.print(rows[-1])
    table = Table(title=f"activation_memory_budget sweep: tiny {args.model}, compiled "
                        f"{args.compile}, batch {args.batch} x {args.seq_len}, CPU")
    for col in ("budget", "measured peak", "memfit", "error", "step (ms)"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["budget"]), f"{r['measured_peak_bytes']:,}",
                      f"{r['memfit_peak_bytes']:,}", f"{r['error_pct']}%", str(r["step_ms"]))
    console.print(table)
    path = _record.write("compiled_budget", {"model": args.model, "compile": args.compile,
                                             "batch": args.batch, "seq_len": args.seq_len,
                                             "torch_threads": torch.get_num_threads()}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
