"""Every GPU check in one run (well under 8 minutes on one GPU): for several zoo models, small
and full-size, the real training step's memory beside memfit's prediction.

First, before anything else touches CUDA, ``memfit.calibrate`` measures this GPU (context,
library kernels, workspace, allocator, one small step) and the profile is recorded as
``benchmarks/results/device_profile-<date>.json``. Each case is then measured with the same
routine (``memfit.calibrate.measure_step``) on step 2 (after
``torch.cuda.reset_peak_memory_stats()``): ``max_memory_allocated``, ``max_memory_reserved``, and
the device-level used memory (``cudaMemGetInfo``: total - free, which includes the CUDA
context). Predicted: ``memfit.estimate(..., device=<this GPU>)`` with the table's figures, and
the device bytes again with the measured profile's (``predicted_device_profiled_bytes``).
Pass marks: allocated within 3%, reserved within 5% (the targets of issue 3).

    python benchmarks/gpu_check.py            # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --dry-run  # predictions only (no GPU needed): checks the script

Results: a table, and ``benchmarks/results/gpu_check-<date>.json`` (one row per case). The
static-plan section (``static_plan_check``) writes ``gpu_static_plan-<date>.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402

import _record  # noqa: E402
from _gpu_seed import seed_check  # noqa: E402
from _timing import CONTROL, interleave  # noqa: E402

# (model, tiny, batch, seq_len or None, precision)
CASES = [
    ("bert-base", True, 8, 64, "fp32"),
    ("gpt2", True, 8, 64, "bf16"),
    ("bert-base", False, 16, 256, "fp32"),
    ("bert-base", False, 16, 256, "fp16"),
    ("gpt2", False, 8, 512, "bf16"),
    ("xlm-roberta-large", False, 8, 256, "fp32"),
    ("xlm-roberta-large", False, 8, 256, "fp16"),
    ("llama-1b", False, 4, 512, "bf16"),
    ("vit-base", False, 32, None, "bf16"),
    ("resnet-50", False, 32, None, "fp32"),
    ("resnet-50", False, 32, None, "bf16-pure"),
]


def measure(spec, tiny: bool, batch_cpu: dict, precision: str) -> dict:
    """Two real Runner steps on the GPU; the second one's memory (memfit.calibrate Note 4)."""
    from memfit.calibrate import measure_step

    model = spec.build(tiny=tiny, device="cuda")
    batch = {k: v.cuda() for k, v in batch_cpu.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runner = memfit.fit(model, opt, batch, precision=precision)
    out = measure_step(runner.step, batch)
    del runner, opt, model, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def offload_overlap(console, rounds: int = 5) -> dict:
    """How much of activation offload's copy time prefetch hides, on this GPU: step time of
    plain / offload without prefetch / offload with prefetch (gpt2, batch 8 x 1024, bf16 or
    fp16). hidden = (t_no_prefetch - t_prefetch) / (t_no_prefetch - t_plain). Each setting's
    peak is read on its own step (the others idle: their bytes are subtracted); then all the
    steps, and a second plain one as the control, are timed interleaved (benchmarks/_timing.py:
    each round runs every setting once; medians over rounds)."""
    from memfit.techniques.offload import Offload

    spec = zoo.get("gpt2")
    precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    out, steps, keep = {}, {}, []
    for label, prefetch in (("plain", None), ("no_prefetch", False), ("prefetch", True),
                            (CONTROL, None)):
        resident = torch.cuda.memory_allocated()
        model = spec.build(device="cuda")
        batch = {k: v.cuda() for k, v in spec.make_batch(model, 8, seq_len=1024).items()}
        if prefetch is not None:
            keep.append(Offload(Offload.Config("all", prefetch=prefetch)).apply(model))
        runner = memfit.fit(model, torch.optim.AdamW(model.parameters()), batch,
                            precision=precision)
        _peak_step(runner, batch)
        if label != CONTROL:
            out[f"{label}_peak_bytes"] = torch.cuda.max_memory_allocated() - resident
        steps[label] = (lambda r=runner, b=batch: r.step(b))
    timings = interleave(steps, rounds, "plain", warmup=1, sync=torch.cuda.synchronize)
    for label in ("plain", "no_prefetch", "prefetch"):
        out[f"{label}_seconds"] = timings.median_s(label)
    out["timing"] = timings.summary()
    for handle in keep:
        handle.remove()
    del steps, keep
    gc.collect()
    torch.cuda.empty_cache()
    copy = out["no_prefetch_seconds"] - out["plain_seconds"]
    out["hidden_fraction"] = (out["no_prefetch_seconds"] - out["prefetch_seconds"]) / copy \
        if copy > 0 else None
    hidden = "n/a" if out["hidden_fraction"] is None else f"{100 * out['hidden_fraction']:.0f}%"
    console.print(f"offload (gpt2 8x1024 {precision}): plain {out['plain_seconds']:.3f} s, "
                  f"no prefetch {out['no_prefetch_seconds']:.3f} s, prefetch "
                  f"{out['prefetch_seconds']:.3f} s; prefetch hides {hidden} of the copy time "
                  f"(control {timings.ratio(CONTROL)})")
    return out


def _peak_step(runner, batch) -> None:
    """One warm-up step, the peak statistics reset, then one step: the peak is this step's."""
    runner.step(batch)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    runner.step(batch)
    torch.cuda.synchronize()


def planner_check(console, spec, dry_run: bool) -> dict:
    """memfit.plan for this GPU at an 11 GiB budget (xlm-roberta-large, 8 x 256, fp32: the
    user's precision), applied with fit: device bytes measured (max reserved + CUDA context,
    steps 2-4) against the budget and the plan's prediction, and the step-time ratio against the
    plain step's beside the predicted one. The planner's CPU comparison with today's recipes is
    benchmarks/planner_vs_recipes.py. Writes ``gpu_planner-<date>.json`` unless ``dry_run``."""
    from memfit.api.plan import plan

    name, bs, seq, budget = "xlm-roberta-large", 8, 256, "11GiB"
    s = zoo.get(name)
    meta = s.build(device="meta")
    batch_cpu = s.make_batch(meta, bs, seq_len=seq)
    with console.status(f"planner: {name} {bs}x{seq} at {budget}"):
        try:
            p = plan(meta, batch_cpu, budget, device=spec)
        except memfit.BudgetTooSmall as e:
            console.print(f"[red]planner: {e}[/red]")
            return {"model": name, "budget": budget, "error": str(e)}
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    out = {"model": name, "batch": [bs, seq], "gpu": spec.name,
           "budget_bytes": memfit.parse_bytes(budget), "knobs": {k: str(v) for k, v in knobs.items()},
           "predicted_device_bytes": p.predicted_device_bytes,
           "predicted_reserved_bytes": p.predicted_reserved_bytes,
           "predicted_time_ratio": p.predicted_step_time_ratio}
    console.print(f"planner ({name} {bs}x{seq}, {budget}): {knobs}, predicted reserved "
                  f"{memfit.format_bytes(p.predicted_reserved_bytes)}, time ratio "
                  f"{p.predicted_step_time_ratio:.2f}")
    if dry_run:
        return out
    settings = (("plain", {}), ("plan", knobs), (CONTROL, {}))
    for label, kn in settings[:2]:       # memory: one runner alive at a time
        runner, batch = _runner(s, batch_cpu, kn)
        _peak_step(runner, batch)
        free, total = torch.cuda.mem_get_info()
        context = total - free - torch.cuda.memory_reserved()
        out[f"{label}_reserved_bytes"] = torch.cuda.max_memory_reserved()
        out[f"{label}_device_bytes"] = torch.cuda.max_memory_reserved() + context
        del runner, batch
        gc.collect()
        torch.cuda.empty_cache()
    steps = {}                           # time: all of them alive, interleaved
    for label, kn in settings:
        runner, batch = _runner(s, batch_cpu, kn)
        steps[label] = (lambda r=runner, b=batch: r.step(b))
    timings = interleave(steps, 3, "plain", warmup=1, sync=torch.cuda.synchronize)
    out["plain_seconds"], out["plan_seconds"] = timings.median_s("plain"), timings.median_s("plan")
    out["time_ratio"] = timings.ratio("plan").median
    out["timing"] = timings.summary()
    del steps
    gc.collect()
    torch.cuda.empty_cache()
    out["fits"] = out["plan_device_bytes"] <= out["budget_bytes"]
    fmt = memfit.format_bytes
    console.print(f"planner measured: plan {fmt(out['plan_device_bytes'])} of {budget} "
                  f"({'fits' if out['fits'] else 'OVER'}; plain {fmt(out['plain_device_bytes'])}),"
                  f" time ratio {timings.ratio('plan')} (predicted "
                  f"{p.predicted_step_time_ratio:.2f}; control {timings.ratio(CONTROL)})")
    console.print(f"recorded in {_record.write('gpu_planner', {'budget': budget}, [out])}")
    return out


# --- static plan (issue 17): the allocator settings memplan models, measured -------------------
STATIC_CASE = ("bert-base", 8, 256, "fp32")    # expandable segments save ~170 MiB (modelled)


def static_plan_check(console, spec, dry_run: bool) -> list[dict]:
    """The static-plan section: one step of ``STATIC_CASE`` under the default allocator and
    under the setting ``memplan.allocator_options`` predicts reserves least, each in a fresh
    process (benchmarks/static_plan.py --gpu-measure: PYTORCH_CUDA_ALLOC_CONF is read once);
    measured ``max_memory_reserved`` beside the modelled reserved; then the replay allocator
    (memplan.replay_allocator) serving steps 2-3 from the static plan, its misses counted, if it
    builds here. Writes ``gpu_static_plan-<date>.json`` unless ``dry_run``."""
    import json
    import os
    import subprocess
    import tempfile

    from memfit.memplan import allocator_options, static_plan
    from memfit.memplan.replay_allocator import unavailable_reason
    from memfit.memplan.replay_match import expected_allocations

    name, bs, seq, precision = STATIC_CASE
    if precision.startswith("bf16") and not spec.supports_bf16:
        precision = "fp16"
    s = zoo.get(name)
    meta = s.build(device="meta")
    batch = s.make_batch(meta, bs, seq_len=seq)
    with console.status(f"static plan: {name} {bs}x{seq} predicted"):
        est = memfit.estimate(meta, batch, "adamw", device=spec, precision=precision)
        opts, sp = allocator_options(est), static_plan(est)
    base = {"model": name, "batch": bs, "seq_len": seq, "precision": precision}
    runs = [(opts.default, None)] + ([(opts.best, None)] if opts.best != opts.default else [])
    runs.append((opts.default, {"expected": expected_allocations(sp),
                                "arena_bytes": sp.arena_bytes, "align_bytes": sp.align_bytes}))
    rows = []
    for option, replay in runs:
        row = {"setting": "replay allocator (static plan)" if replay else option.name,
               "predicted_reserved_bytes": sp.arena_bytes if replay else option.reserved_bytes,
               "lower_bound_bytes": sp.lower_bound_bytes}
        reason = unavailable_reason() if replay else None
        if reason:
            row["error"] = reason
        elif not dry_run:
            cfg = dict(base, scheme=option.scheme, replay=replay)
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:"
                       + str(option.expandable_segments))
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump(cfg, f)
            worker = [sys.executable, str(Path(__file__).parent / "static_plan.py"),
                      "--gpu-measure", f.name]
            with console.status(f"static plan: {row['setting']} measured (a fresh process)"):
                try:
                    done = subprocess.run(worker, env=env, capture_output=True, text=True,
                                          timeout=420)
                except subprocess.TimeoutExpired:
                    done = subprocess.CompletedProcess(worker, -1, "", "timed out after 420 s")
            os.unlink(f.name)
            if done.returncode == 0:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = done.stderr.strip()[-600:]
        rows.append(row)
    fmt = memfit.format_bytes
    table = Table(title=f"static plan: {name} {bs}x{seq} {precision} on {spec.display_name}")
    for col in ("setting", "predicted reserved", "measured reserved", "replay misses / hits",
                "note"):
        table.add_column(col, justify="left" if col in ("setting", "note") else "right")
    for r in rows:
        hits = f"{r['replay_misses']} / {r['replay_hits']}" if "replay_hits" in r else "-"
        table.add_row(r["setting"], fmt(r["predicted_reserved_bytes"]) + " (modelled)",
                      fmt(r["measured_reserved_bytes"]) if "measured_reserved_bytes" in r else "-",
                      hits, r.get("error", "")[:160] or ("dry run" if dry_run else ""))
    console.print(table)
    console.print(f"static plan: lower bound {fmt(sp.lower_bound_bytes)}, arena "
                  f"{fmt(sp.arena_bytes)}; best setting {opts.best.name} predicted to save "
                  f"{fmt(opts.saved_bytes)} against the default (modelled)")
    if not dry_run:
        console.print(f"recorded in {_record.write('gpu_static_plan', base, rows)}")
    return rows


def _runner(s, batch_cpu, knobs):
    model = s.build(device="cuda")
    batch = {k: v.cuda() for k, v in batch_cpu.items()}
    return memfit.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-5), batch, **knobs), batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="predict only; no GPU needed")
    ap.add_argument("--gpu", default=None,
                    help="GPU table name to predict for (default: the GPU in this machine)")
    args = ap.parse_args()
    console = Console(width=160)
    if not args.dry_run and not torch.cuda.is_available():
        console.print("[red]no CUDA device: run on a GPU machine, or pass --dry-run[/red]")
        raise SystemExit(2)
    profiled = None
    if not args.dry_run:            # first: the context is measured in a fresh process
        from memfit.calibrate import calibrate, write_profile

        with console.status("calibrating this GPU (memfit calibrate)"):
            profile = calibrate()
        path = _record.fresh_path("device_profile")
        write_profile(profile, str(path))
        profiled = memfit.DeviceSpec.load(str(path))
        console.print(f"device profile recorded in {path}")
    spec = memfit.get_device(args.gpu or ("cuda" if torch.cuda.is_available() else "h200"))
    table = Table(title=f"gpu_check on {spec.display_name}: predicted vs measured, step 2")
    for col in ("model", "batch", "prec", "pred alloc", "meas alloc", "err", "pred reserved",
                "meas reserved", "err", "pred device", "meas device", "est s"):
        table.add_column(col, justify="right")
    rows = []
    for name, tiny, bs, seq, precision in CASES:
        s = zoo.get(name)
        if precision.startswith("bf16") and not spec.supports_bf16:
            precision = "fp16" if precision == "bf16" else "fp32"
        meta = s.build(tiny=tiny, device="meta")
        vision = s.family == "vision"
        batch = s.make_batch(meta, bs, seq_len=None if vision else seq)
        with console.status(f"{name}: predicting"):
            start = time.perf_counter()
            est = memfit.estimate(meta, batch, "adamw", device=spec, precision=precision)
            est_s = time.perf_counter() - start
        row = {"model": name, "tiny": tiny, "gpu": spec.name, "precision": precision,
               "batch": list(batch.get("input_ids", batch.get("pixel_values")).shape),
               "predicted_allocated_bytes": est.peak_bytes,
               "predicted_reserved_bytes": est.reserved_bytes,
               "predicted_device_used_bytes": est.device_bytes,
               "predicted_context_bytes": est.context_bytes, "estimate_seconds": round(est_s, 3),
               "predicted_card": est.card.to_dict() if est.card is not None else None,
               "predicted_device_profiled_bytes": None if profiled is None else
               est.reserved_bytes + profiled.cuda_context_bytes
               + (profiled.cudnn_bytes if est.card and est.card.cudnn_bytes else 0),
               "attention": est.notes[0] if est.notes else ""}
        if not args.dry_run:
            with console.status(f"{name}: two real steps"):
                row.update(measure(s, tiny, batch, precision))
            row["allocated_error"] = row["predicted_allocated_bytes"] / row["measured_allocated_bytes"] - 1
            row["reserved_error"] = row["predicted_reserved_bytes"] / row["measured_reserved_bytes"] - 1
            row["pass"] = abs(row["allocated_error"]) <= 0.03 and abs(row["reserved_error"]) <= 0.05
        rows.append(row)
        fmt = memfit.format_bytes
        m = lambda key: fmt(row[key]) if key in row else "-"
        e = lambda key: f"{100 * row[key]:+.1f}%" if key in row else "-"
        table.add_row(name + (" (tiny)" if tiny else ""), "x".join(map(str, row["batch"])),
                      precision, fmt(est.peak_bytes), m("measured_allocated_bytes"),
                      e("allocated_error"), fmt(est.reserved_bytes), m("measured_reserved_bytes"),
                      e("reserved_error"), fmt(est.device_bytes), m("measured_device_used_bytes"),
                      f"{est_s:.1f}")
    console.print(table)
    planner_check(console, spec, args.dry_run)
    static_plan_check(console, spec, args.dry_run)
    seed_check(console, spec, args.dry_run)
    if args.dry_run:
        console.print("dry run: predictions only, nothing recorded")
        return
    passed = sum(r["pass"] for r in rows)
    console.print(f"{passed}/{len(rows)} within 3% (allocated) and 5% (reserved)")
    path = _record.write("gpu_check", {"cases": CASES, "gpu": spec.name}, rows)
    console.print(f"recorded in {path}")
    with console.status("offload: how much copy time prefetch hides"):
        overlap = offload_overlap(console)
    path = _record.write("gpu_offload_overlap", {"model": "gpt2", "batch": [8, 1024],
                                                 "gpu": spec.name}, [overlap])
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
