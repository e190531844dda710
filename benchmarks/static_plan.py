"""Static arena (memfit.memplan) vs the caching allocator, per zoo model, side by side in one run.

    python benchmarks/static_plan.py [--quick] [--gpu gtx-1080-ti] [--models a,b]

Per model (full size on the meta device, one steady-state step traced for a GPU, AdamW, fp32):
the lower bound (peak of live bytes, 512 B blocks), the static arena (best of greedy by size
and greedy by lifetime), the caching allocator's reserved peak as memfit's allocator model
replays the step (default, expandable_segments, MemPools by phase, by lifetime class), and the
share of the reserved-minus-lower-bound gap the arena closes. Every reserved figure is
MODELLED (memfit.trace.allocator), not measured: no GPU ran here. Then greedy vs the exact
MILP (HiGHS) on small graphs: seeded random lifetimes, and windows of a real traced step
(the storages born in W consecutive ops, cut to that window), where the greedy layout's
distance from the optimum is measured.

``--gpu-measure CONFIG.json`` is the GPU worker benchmarks/gpu_check.py starts once per
allocator setting (a fresh process each: ``PYTORCH_CUDA_ALLOC_CONF`` is read once, and the replay
allocator must replace the allocator before the first CUDA tensor): it trains the configured
zoo model on the GPU for a few steps under that setting and prints one JSON line of what it
measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

import _record
import memfit
from memfit import zoo
from memfit.memplan import allocator_options, static_plan
from memfit.memplan._exact import exact_offsets
from memfit.memplan._greedy import arena_of, greedy_by_lifetime, greedy_by_size

MODELS = [  # name, batch, sequence length (None: the model's image size)
    ("xlm-roberta-large", 8, 256),        # the README's default step
    ("bert-base", 8, 256), ("roberta-large", 8, 256), ("gpt2", 8, 512), ("gpt2-medium", 4, 512),
    ("llama-1b", 2, 512), ("t5-base", 8, 256), ("vit-base", 16, None), ("resnet-50", 16, None),
]
QUICK = [("xlm-roberta-base", 4, 128), ("gpt2", 2, 128)]
MiB = 1 << 20


def model_row(name, bs, seq, gpu, tiny=False) -> dict:
    spec = zoo.get(name)
    model = spec.build(tiny=tiny, device="meta")
    batch = spec.make_batch(model, bs, seq_len=seq) if seq else spec.make_batch(model, bs)
    t0 = time.perf_counter()
    est = memfit.estimate(model, batch, optimizer="adamw", device=gpu)
    t1 = time.perf_counter()
    sp = static_plan(est)
    t2 = time.perf_counter()
    opts = allocator_options(est)
    t3 = time.perf_counter()
    by = {o.name: o.reserved_bytes for o in opts.options}
    return {"model": name, "batch": bs, "seq_len": seq, "storages": len(sp.assignments),
            "lower_bound_bytes": sp.lower_bound_bytes, "arena_bytes": sp.arena_bytes,
            "method": sp.method, "greedy_by_size_bytes": sp.greedy_by_size_bytes,
            "greedy_by_lifetime_bytes": sp.greedy_by_lifetime_bytes,
            "allocated_peak_bytes": est.peak_bytes, "reserved_bytes": est.reserved_bytes,
            "reserved_by_setting_bytes": by, "best_setting": opts.best.name,
            "best_setting_saved_bytes": opts.saved_bytes,
            "arena_over_lower_bound": sp.arena_bytes / sp.lower_bound_bytes,
            "reserved_over_lower_bound": est.reserved_bytes / sp.lower_bound_bytes,
            "arena_saved_bytes": sp.saved_bytes, "gap_closed": sp.gap_closed,
            "classes": opts.classes, "trace_seconds": round(t1 - t0, 1),
            "plan_seconds": round(t2 - t1, 2), "options_seconds": round(t3 - t2, 2)}


def small_graphs(gpu, seed=0, windows=(40, 80), sizes=(10, 16, 24)) -> list[dict]:
    rows, rng = [], np.random.default_rng(seed)
    for n in sizes:
        for k in range(3):
            s = rng.integers(1, 32, n) * 512
            f = rng.integers(0, 2 * n, n)
            l = f + rng.integers(0, n // 2, n)
            rows.append(_compare(f"random n={n} #{k}", s, f, l))
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    est = memfit.estimate(model, spec.make_batch(model, 2, seq_len=16), device=gpu)
    life = est.lifetimes.window()
    sizes_b = -(-life.nbytes // 512) * 512
    for w in windows:
        for start in (int(est.phases["forward"]) + 5, int(est.phases["backward"]) + 5):
            sel = (life.first_op >= start) & (life.first_op < start + w)
            f = life.first_op[sel] - start
            l = np.minimum(life.last_op[sel], start + w - 1) - start
            rows.append(_compare(f"tiny gpt2 ops {start}..{start + w - 1}", sizes_b[sel], f, l))
    return rows


def _compare(label, s, f, l) -> dict:
    t = max(int(l.max()) + 1, 1)
    diff = np.zeros(t + 2, dtype=np.int64)
    np.add.at(diff, f + 1, s)
    np.add.at(diff, l + 2, -s)
    lb = int(np.cumsum(diff).max())
    by_size = arena_of(s, greedy_by_size(s, f, l))
    by_life = arena_of(s, greedy_by_lifetime(s, f, l))
    ex = exact_offsets(s, f, l, min(by_size, by_life), lb, time_limit_s=20.0)
    return {"graph": label, "storages": len(s), "lower_bound_bytes": lb,
            "greedy_by_size_bytes": by_size, "greedy_by_lifetime_bytes": by_life,
            "exact_bytes": ex.arena_bytes, "exact_optimal": ex.optimal,
            "exact_bound_bytes": ex.bound_bytes, "exact_seconds": round(ex.seconds, 2),
            "pairs": ex.pairs,
            "best_greedy_over_exact": min(by_size, by_life) / ex.arena_bytes}


def gpu_measure(config_path: str) -> dict:
    """The GPU worker (module docstring): ``{"model", "batch", "seq_len", "precision",
    "scheme", "replay": null or {"expected", "arena_bytes", "align_bytes"}}``; the allocator
    config comes in the environment. Measured on step 2 (the caching allocator's peak
    statistics), or, under the replay allocator (which keeps none), its hit / miss counts over
    steps 2-3 and the device's used bytes (cudaMemGetInfo)."""
    cfg = json.loads(Path(config_path).read_text())
    replay = None
    if cfg.get("replay"):
        from memfit.memplan.replay_allocator import ReplayAllocator

        replay = ReplayAllocator.build()
        replay.install()                  # before the first CUDA tensor
    import torch

    from memfit.runtime.mem_pools import PhasePools

    spec = zoo.get(cfg["model"])
    meta = spec.build(device="meta")
    batch_cpu = spec.make_batch(meta, cfg["batch"], seq_len=cfg["seq_len"])
    model = spec.build(device="cuda")
    batch = {k: v.cuda() for k, v in batch_cpu.items()}
    runner = memfit.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-5), batch,
                        precision=cfg["precision"])
    pools = PhasePools(cfg["scheme"])           # as build_runner applies a plan's setting
    if pools.active:
        runner.on_phase = pools.on_phase
        runner.contexts.append(lambda: pools)
    if replay is None:
        from memfit.calibrate import measure_step

        return measure_step(runner.step, batch)
    runner.step(batch)                            # step 1: unarmed (state created)
    torch.cuda.synchronize()
    r = cfg["replay"]
    replay.arm_expected([tuple(e) for e in r["expected"]], r["arena_bytes"], r["align_bytes"],
                        torch.cuda.current_device())
    for _ in range(2):
        replay.begin_step()
        runner.step(batch)
        torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    stats = replay.stats()
    return {"replay_hits": stats.hits, "replay_misses": stats.misses,
            "replay_conflicts": stats.conflicts, "replay_beyond_plan": stats.beyond_plan,
            "replay_expected_per_step": len(r["expected"]),
            "measured_device_used_bytes": total - free}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu-measure", default=None, metavar="CONFIG.json",
                    help="run as benchmarks/gpu_check.py's GPU worker (module docstring)")
    ap.add_argument("--quick", action="store_true", help="two small models at short lengths")
    ap.add_argument("--gpu", default="gtx-1080-ti", help="the GPU modelled (default: the seed's)")
    ap.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    args = ap.parse_args()
    if args.gpu_measure:
        print(json.dumps(gpu_measure(args.gpu_measure)))
        return
    models = QUICK if args.quick else MODELS
    if args.models:
        want = args.models.split(",")
        models = [m for m in MODELS + QUICK if m[0] in want]
    console = Console(width=200)
    rows = []
    for name, bs, seq in models:
        with console.status(f"{name}: tracing and planning"):
            rows.append(model_row(name, bs, seq, args.gpu))
        r = rows[-1]
        console.print(f"{name}: {r['storages']} storages, arena/lower bound "
                      f"{r['arena_over_lower_bound']:.4f}, reserved/lower bound "
                      f"{r['reserved_over_lower_bound']:.4f} ({r['trace_seconds']} s trace, "
                      f"{r['plan_seconds']} s plan)")
    table = Table(title=f"static arena vs caching allocator, {args.gpu} (reserved: MODELLED)")
    for col in ("model", "lower bound", "arena", "arena/LB", "reserved", "expandable",
                "phase pools", "phase+exp", "class pools", "gap closed", "best setting"):
        table.add_column(col, justify="left" if col in ("model", "best setting") else "right")
    for r in rows:
        by = r["reserved_by_setting_bytes"]
        table.add_row(r["model"], f"{r['lower_bound_bytes'] / MiB:.0f}",
                      f"{r['arena_bytes'] / MiB:.0f}", f"{r['arena_over_lower_bound']:.4f}",
                      f"{by['default'] / MiB:.0f}",
                      f"{by['default + expandable_segments'] / MiB:.0f}",
                      f"{by['phase-pools'] / MiB:.0f}",
                      f"{by['phase-pools + expandable_segments'] / MiB:.0f}",
                      f"{by['class-pools'] / MiB:.0f}", f"{100 * r['gap_closed']:.1f}%",
                      f"{r['best_setting']} (-{r['best_setting_saved_bytes'] / MiB:.0f})")
    console.print(table)
    console.print("MiB; lower bound = peak live bytes in 512 B blocks; reserved = memfit's "
                  "caching-allocator model (no GPU measured it)")
    with console.status("small graphs: greedy vs exact (HiGHS)"):
        small = small_graphs(args.gpu)
    t2 = Table(title="greedy vs exact on small graphs (bytes over the lower bound)")
    for col in ("graph", "n", "pairs", "LB", "by size", "by lifetime", "exact", "optimal",
                "greedy/exact", "s"):
        t2.add_column(col, justify="left" if col == "graph" else "right")
    for r in small:
        lb = r["lower_bound_bytes"]
        t2.add_row(r["graph"], str(r["storages"]), str(r["pairs"]), str(lb),
                   f"+{r['greedy_by_size_bytes'] - lb}", f"+{r['greedy_by_lifetime_bytes'] - lb}",
                   f"+{r['exact_bytes'] - lb}", "yes" if r["exact_optimal"] else "no",
                   f"{r['best_greedy_over_exact']:.4f}", str(r["exact_seconds"]))
    console.print(t2)
    readme = next((r for r in rows if r["model"] == "xlm-roberta-large"), None)
    if readme:
        console.print(f"README default (xlm-roberta-large b8 x 256, {args.gpu}): the static arena "
                      f"saves {readme['arena_saved_bytes'] / MiB:.0f} MiB of the modelled "
                      f"reserved {readme['reserved_bytes'] / MiB:.0f} MiB; the best PyTorch "
                      f"setting ({readme['best_setting']}) saves "
                      f"{readme['best_setting_saved_bytes'] / MiB:.0f} MiB. Not confirmed on a "
                      "GPU: benchmarks/gpu_check.py's static-plan section measures the settings "
                      "on one (none ran for this record)")
    path = _record.write("static_plan" + ("-quick" if args.quick else ""),
                         {"gpu": args.gpu, "models": models, "optimizer": "adamw",
                          "precision": "fp32", "reserved": "modelled (memfit.trace.allocator)",
                          "exact_time_limit_s": 20.0, "small_graph_windows_ops": [40, 80],
                          "small_graph_random_sizes": [10, 16, 24]}, rows + [{"small_graphs": small}])
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
