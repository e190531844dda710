"""torch.compile's ``activation_memory_budget`` sweep: the real compiled CPU step beside memfit's
estimate of it, budget by budget, in one run.

    python benchmarks/compiled_budget.py [--model llama-1b] [--compile blocks] [--quick] [--plan]

For each budget (1.0, the default, down to 0.0) a fresh process compiles the model (tiny
config, random weights) with Inductor, as ``memfit estimate --compile`` does, runs the plain
loop and reports the third step's peak live CPU bytes, from the CPU allocator's own events
(``torch.profiler``, tests/trace/_compiled_oracle.py), and the median wall time of five more
steps. memfit's estimate of the same step (``--activation-memory-budget``) is printed beside
it, with its error. The budget trades activation memory for recompute: the rows show what
each setting holds and costs, and whether memfit's answer follows it.

``--plan``: at equal memory. For each budget below 1.0, ``memfit.plan`` of the compiled job is
asked to fit the peak that budget's real step reached (memfit weighs the budget against
micro-batches and the optimizer's levers, api/plan.py Note 3), and its plan is then run for
real (``memfit.fit`` with the plan's knobs, in a fresh process): its measured peak and step
time are printed beside the sweep's. Beside budget 1.0, the control: ``memfit.fit``'s runner
with no knob, whose step time against the plain loop's is the runner's own overhead. Step
times come from separate processes run one after another on a shared machine: compare them
as such.

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


_PLANNED = """
import json, statistics, sys, time, torch, warnings
from torch.profiler import ProfilerActivity, profile
import memfit
from tests.trace._compiled_oracle import allocator_peak, build, compile_as
job, knobs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
warnings.simplefilter("ignore")
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    _, model, batch = build(job)
    model = compile_as(model, job["compile"])
    runner = memfit.fit(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), batch, **knobs)
    for i in range(3):
        with torch.profiler.record_function(f"step{i}"):
            runner.step(batch)
times = []
for i in range(8):
    start = time.perf_counter()
    runner.step(batch)
    times.append(time.perf_counter() - start)
print(json.dumps({"peak": allocator_peak(prof, "step2"), "step_s": statistics.median(times[3:])}))
"""


def real_step(job: dict, knobs: dict | None = None) -> dict:
    """The job's real compiled step in a fresh process: the plain loop, or (``knobs``)
    ``memfit.fit``'s runner with those knobs."""
    args = [_TIMED, json.dumps(job)] if knobs is None else [_PLANNED, json.dumps(job),
                                                          json.dumps(knobs)]
    out = subprocess.run([sys.executable, "-c", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned_at(job: dict, budget_bytes: int) -> dict:
    """memfit's plan of the compiled job (torch's default partition as given) for
    ``budget_bytes``, run for real: its knobs, measured peak and step time."""
    import memfit
    from tests.trace._compiled_oracle import build, compile_as

    _, model, batch = build(job)
    t = time.perf_counter()
    try:
        plan = memfit.plan(memfit.Job(compile_as(model, job["compile"]), batch),
                           budget=budget_bytes)
    except memfit.BudgetTooSmall as e:
        return {"plan": f"none fits ({e.floor_bytes:,} B floor)"}
    plan_s = time.perf_counter() - t
    knobs = {k: v for k, v in plan.knobs.to_dict().items()     # 0.0 is a budget, not unset
             if v is not None and v is not False and v != "none" and k != "precision"}
    real = real_step({k: v for k, v in job.items() if k != "activation_memory_budget"}, knobs)
    return {"plan": ", ".join(f"{k}={v}" for k, v in knobs.items()) or "the plain step",
            "plan_predicted_peak_bytes": plan.predicted_peak_bytes,
            "plan_measured_peak_bytes": real["peak"], "plan_step_ms": round(1000 * real["step_s"], 2),
            "plan_under_budget": real["peak"] <= budget_bytes, "memfit_plan_s": round(plan_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1b", help="a zoo model, built tiny")
    ap.add_argument("--compile", default="blocks", choices=("model", "blocks"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="budgets 1.0 and 0.0 only")
    ap.add_argument("--plan", action="store_true",
                    help="also plan each budget's measured peak with memfit.plan and run the "
                         "plan for real, at equal memory (about a minute per budget)")
    args = ap.parse_args()
    console = Console(width=200)
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
        if args.plan and b < 1.0:
            rows[-1].update(planned_at(job, real["peak"]))
        elif args.plan:            # the control: memfit's runner with nothing applied
            ctl = real_step({k: v for k, v in job.items() if k != "activation_memory_budget"},
                            {})
            rows[-1].update({"plan": "control: memfit.fit's runner, no knobs",
                             "plan_measured_peak_bytes": ctl["peak"],
                             "plan_step_ms": round(1000 * ctl["step_s"], 2)})
        console.print(rows[-1])
    table = Table(title=f"activation_memory_budget sweep: tiny {args.model}, compiled "
                        f"{args.compile}, batch {args.batch} x {args.seq_len}, CPU")
    cols = ["budget", "measured peak", "memfit", "error", "step (ms)"]
    cols += ["memfit's plan at that peak", "its measured peak", "its step (ms)"] \
        if args.plan else []
    for col in cols:
        table.add_column(col)
    for r in rows:
        cells = [str(r["budget"]), f"{r['measured_peak_bytes']:,}",
                 f"{r['memfit_peak_bytes']:,}", f"{r['error_pct']}%", str(r["step_ms"])]
        if args.plan:
            peak = r.get("plan_measured_peak_bytes")
            cells += [r.get("plan", ""), f"{peak:,}" if peak else "",
                      str(r.get("plan_step_ms", ""))]
        table.add_row(*cells)
    console.print(table)
    path = _record.write("compiled_budget", {"model": args.model, "compile": args.compile,
                                             "batch": args.batch, "seq_len": args.seq_len,
                                             "plan": args.plan,
                                             "torch_threads": torch.get_num_threads()}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
