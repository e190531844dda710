"""The time model's CPU constants, fitted on one configuration and tested on others.

    python benchmarks/time_model_calibration.py [--rounds 5] [--quick] [--threads N]

Calibration: tiny gpt2, the plain fp32 step at 1, 2, 4 and 8 micro-batches (the per-op CPU
overhead is what each extra micro-batch repeats, time_model Note 3). Held out: the same model
with recompute, selective recompute, activation offload and optimizer offload, and two other
architectures (bert, llama) with micro-batching, recompute and offload. For every configuration
the measured step-time ratio to the plain step (interleaved timing, Note 3) is printed beside
the ratio memfit's time model predicts, at the shipped constants and at the fitted ones.

Note 1 (the model as a function of its constants). On a CPU target memfit's time model
(src/memfit/planner/time_model.py) predicts ``step_s = L * launches + flops / (F * 0.6) +
bytes / (B * 0.8)`` plus the offload transfers (at the host link rate, the RAM bandwidth ``B``
on a CPU). This script evaluates memfit's own ``TimeModel``, built from memfit's traces as
``memfit.plan`` builds it (the plain trace at the batch and one at half the batch), at candidate
constants: ``F``, ``B`` through the ``DeviceSpec`` (``dataclasses.replace`` of ``cpu_spec()``),
``L`` by building the model with ``time_model._LAUNCH_S["cpu"]`` set to the candidate
(``unittest.mock.patch.dict``, restored at once): time_model reads the per-op constant from
that table and has no parameter for it. Nothing else in memfit is touched.

Note 2 (what can be fitted). The planner only compares plans by their ratio, and a ratio does
not change when every constant is scaled alike: from ratios, only the per-op overhead *relative
to* the FLOP and byte rates can be fitted. The micro-batch sweep pins exactly that (the ratio
grows linearly with the number of micro-batches, and its slope is the repeated overhead over
the whole step), so the primary fit is ``L`` alone with ``F`` and ``B`` as shipped, least squares
on log ratios (each ratio within one round). A second fit on the absolute median CPU seconds,
``t = L * launches + s * (flop and byte terms)``, adds ``s``: how many times slower than
``cpu_spec()``'s rates this machine ran the FLOP/byte terms. It is indicative only: on a loaded
machine even CPU seconds stretch (shared caches and memory bandwidth).

Note 3 (timing). Each model's settings are built and kept, then timed interleaved
(benchmarks/_timing.py: every setting once per round, balanced order, ratios to the plain step
of the same round, median over rounds, quartiles as the spread), with a second plain runner as
the control (should read 1.00x). The fit reads the CPU-time ratios (the process's CPU time per
step, _timing Note 4): with one torch thread they are the step's work without the waits for a
core that other jobs hold, which on this oversubscribed machine are most of the wall time; the
wall-time ratios are recorded and printed beside them.

Note 4 (threads). One torch thread by default (``--threads``). ``cpu_spec()`` assumes every
logical core at work, so the predictions here use its FLOP rate scaled by threads / cores: the
per-op overhead is a single-threaded cost (the Python module and the dispatcher), while the
FLOP rate grows with the threads, so ``L`` fitted this way is the constant for any core count.
Bandwidth is left as shipped (one thread reaches less of it: the fit absorbs that into ``L``
only as far as the calibration steps are bandwidth-bound).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402
from memfit.devices import cpu_spec  # noqa: E402
from memfit.planner import time_model  # noqa: E402
from memfit.planner.memory_model import MemoryModel  # noqa: E402
from memfit.planner.time_model import TimeModel  # noqa: E402

import _record  # noqa: E402
from _timing import CONTROL, interleave  # noqa: E402

BATCH = 8
MODELS = {
    "gpt2": (dict(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, bos_token_id=0,
                  eos_token_id=0), 128),
    "bert-base": (dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                       intermediate_size=1024, vocab_size=2048), 128),
    "llama-1b": (dict(num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0), 128),
}
CALIBRATION_MODEL = "gpt2"
CALIBRATION = [dict(micro_batch_size=m) for m in (4, 2, 1)]        # 2, 4, 8 micro-batches
HELD_OUT = {
    "gpt2": [dict(checkpoint="all"), dict(checkpoint="selective"), dict(offload="all"),
             dict(offload_optimizer=True), dict(micro_batch_size=2, checkpoint="all")],
    "bert-base": [dict(micro_batch_size=2), dict(checkpoint="all"), dict(offload="all")],
    "llama-1b": [dict(micro_batch_size=2), dict(checkpoint="all"), dict(offload="all"),
                 dict(checkpoint="selective")],
}
QUICK_HELD_OUT = {
    "gpt2": [dict(checkpoint="all"), dict(offload="all")],
    "llama-1b": [dict(micro_batch_size=2), dict(checkpoint="all")],
}
QUICK_SEQ_LEN = 64
_MODES = {"all": "recompute", "selective": "selective"}


def label_of(knobs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items()) or "plain"


def shipped_launch_s() -> float:
    table = getattr(time_model, "_LAUNCH_S", None)
    if not isinstance(table, dict) or "cpu" not in table:
        raise SystemExit("memfit.planner.time_model has no _LAUNCH_S['cpu'] table any more: "
                         "update benchmarks/time_model_calibration.py (Note 1) to its new "
                         "per-op constant")
    return float(table["cpu"])


class Predictor:
    """memfit's time model of one model's plain step, at any CPU constants (Note 1)."""

    def __init__(self, model, batch, half_batch, threads: int):
        full = cpu_spec()
        scale = threads / (os.cpu_count() or 1)            # Note 4
        self.spec = dataclasses.replace(full, peak_fp32_flops=full.peak_fp32_flops * scale,
                                        peak_fp16_flops=full.peak_fp16_flops * scale,
                                        peak_bf16_flops=full.peak_bf16_flops * scale)
        self.est = memfit.estimate(model, batch, "adamw", device=self.spec, precision="fp32")
        self.half = memfit.estimate(model, half_batch, "adamw", device=self.spec,
                                    precision="fp32", allocator_replay=False)
        self.memory = MemoryModel(self.est, BATCH, self.half)

    def time_model(self, launch_s: float, throughput_scale: float = 1.0) -> TimeModel:
        spec = dataclasses.replace(
            self.spec, peak_fp32_flops=self.spec.peak_fp32_flops / throughput_scale,
            memory_bandwidth_bytes_per_s=self.spec.memory_bandwidth_bytes_per_s
            / throughput_scale,
            host_link_bytes_per_s=self.spec.host_link_bytes_per_s / throughput_scale)
        with mock.patch.dict(time_model._LAUNCH_S, {"cpu": launch_s}):
            return TimeModel(self.est, spec, "fp32", BATCH, self.memory, self.half)

    def step_s(self, knobs: dict, launch_s: float, throughput_scale: float = 1.0) -> float:
        t = self.time_model(launch_s, throughput_scale)
        n = len(self.memory.blocks)
        modes = ["keep"] * n
        if knobs.get("checkpoint"):
            modes = [_MODES[knobs["checkpoint"]]] * n
        if knobs.get("offload"):
            modes = ["offload"] * n
        m = knobs.get("micro_batch_size", BATCH)
        return t.step_s(m, BATCH, tuple(modes), bool(knobs.get("offload_optimizer")))

    def ratio(self, knobs: dict, launch_s: float, throughput_scale: float = 1.0) -> float:
        return self.step_s(knobs, launch_s, throughput_scale) / \
            self.step_s({}, launch_s, throughput_scale)


def build_runner(spec, overrides, seq, knobs):
    torch.manual_seed(0)
    model = spec.build(seed=0, **overrides)
    batch = spec.make_batch(model, BATCH, seq_len=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runner = memfit.fit(model, opt, batch, **knobs)
    runner.step(batch)
    prepared = runner.prepare(batch)
    return runner, (lambda: runner.run(prepared))


def measure_model(name, seq, settings, rounds, console):
    """Interleaved ratios of ``settings`` to the plain step, and the model's Predictor."""
    spec = zoo.get(name)
    overrides = MODELS[name][0]
    model = spec.build(seed=0, **overrides)
    with console.status(f"{name}: tracing the plain step (batch {BATCH} and {BATCH // 2})"):
        predictor = Predictor(model, spec.make_batch(model, BATCH, seq_len=seq),
                              spec.make_batch(model, BATCH // 2, seq_len=seq),
                              torch.get_num_threads())
    runners, steps = [], {}
    for label, knobs in [("plain", {}), (CONTROL, {}),
                         *((label_of(k), k) for k in settings)]:
        with console.status(f"{name}: building {label}"):
            runner, steps[label] = build_runner(spec, overrides, seq, knobs)
        runners.append(runner)
    with console.status(f"{name}: timing") as status:
        timings = interleave(steps, rounds, "plain", warmup=1, on_round=lambda r, n: status.update(
            f"{name}: timing {len(steps)} settings interleaved, round {r + 1}/{n}"))
    for runner in runners:
        runner.close()
    return timings, predictor


def _linear(p: Predictor, knobs: dict) -> tuple[float, float]:
    """(seconds at L = 0, launches): the step is linear in L where no max() is involved."""
    rest = p.step_s(knobs, 0.0)
    return rest, (p.step_s(knobs, 1e-4) - rest) / 1e-4


def fit_launch(points, shipped: float) -> float:
    """Least squares on log ratios over L (Note 2): each ratio is (a + b L) / (a1 + b1 L), from
    the model at two values of L; a log grid around the shipped value, then a finer one around
    its best point."""
    coeffs = [(*_linear(p, knobs), *_linear(p, {}), measured) for p, knobs, measured in points]

    def losses(grid):
        out = np.zeros_like(grid)
        for a, b, a1, b1, measured in coeffs:
            out += (np.log((a + b * grid) / (a1 + b1 * grid)) - np.log(measured)) ** 2
        return out

    grid = np.geomspace(shipped / 1000, shipped * 100, 4001)
    i = int(np.argmin(losses(grid)))
    fine = np.linspace(grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)], 2001)
    best = float(fine[int(np.argmin(losses(fine)))])
    p, knobs, _ = points[0]
    a, b, a1, b1, _ = coeffs[0]
    assert abs(p.ratio(knobs, best) - (a + b * best) / (a1 + b1 * best)) < 1e-9, \
        "the time model is not linear in its per-op constant any more: refit another way"
    return best


def fit_absolute(points_s):
    """``t = L * launches + s * rest`` on median seconds, relative least squares (Note 2)."""
    rows = []
    for p, knobs, seconds in points_s:
        rest, launches = _linear(p, knobs)
        rows.append([launches / seconds, rest / seconds])
    (launch, scale), *_ = np.linalg.lstsq(np.array(rows), np.ones(len(rows)), rcond=None)
    return float(launch), float(scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds (default 5, --quick 3)")
    ap.add_argument("--quick", action="store_true",
                    help=f"sequence {QUICK_SEQ_LEN}, gpt2 and llama only, fewer held-out "
                         "settings, 3 rounds: a few minutes")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: Note 4)")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    if rounds < 1 or args.threads < 1:
        ap.error("--rounds and --threads need at least 1")
    torch.set_num_threads(args.threads)
    console = Console(width=160)
    shipped = shipped_launch_s()
    held_out = QUICK_HELD_OUT if args.quick else HELD_OUT
    start = time.perf_counter()
    results = {}
    for name in held_out:
        seq = QUICK_SEQ_LEN if args.quick else MODELS[name][1]
        settings = (CALIBRATION if name == CALIBRATION_MODEL else []) + held_out[name]
        results[name] = measure_model(name, seq, settings, rounds, console)

    timings, predictor = results[CALIBRATION_MODEL]
    calib = [(predictor, k, timings.ratio(label_of(k), clock="cpu").median) for k in CALIBRATION]
    launch = fit_launch(calib, shipped)
    wall_launch = fit_launch([(predictor, k, timings.ratio(label_of(k)).median)
                              for k in CALIBRATION], shipped)
    seconds = [(predictor, k, timings.median_s(label_of(k), "cpu")) for k in [{}, *CALIBRATION]]
    abs_launch, abs_scale = fit_absolute(seconds)

    rows = []
    table = Table(title=f"time model on this CPU: measured vs predicted step-time ratios to the "
                        f"plain step (median [quartiles] of {rounds} interleaved rounds; CPU "
                        "time, wall time beside)")
    for col in ("model", "setting", "role", "measured (CPU)", "measured (wall)",
                f"pred. L={shipped * 1e6:.0f}us", "err", f"pred. L={launch * 1e6:.1f}us (fit)",
                "err"):
        table.add_column(col, justify="left" if col in ("model", "setting", "role") else "right")
    for name, (timings, predictor) in results.items():
        for knobs in [{}, *((CALIBRATION if name == CALIBRATION_MODEL else []) + held_out[name])]:
            label = label_of(knobs) if knobs else CONTROL
            role = "control" if not knobs else (
                "calibration" if name == CALIBRATION_MODEL and knobs in CALIBRATION
                else "held out")
            measured = timings.ratio(label, clock="cpu")
            pred_shipped, pred_fit = predictor.ratio(knobs, shipped), predictor.ratio(knobs, launch)
            row = {"model": name, "setting": label, "role": role, **timings.row(label),
                   "predicted_ratio_shipped": round(pred_shipped, 4),
                   "predicted_ratio_fitted": round(pred_fit, 4),
                   "error_shipped": round(pred_shipped / measured.median - 1, 4),
                   "error_fitted": round(pred_fit / measured.median - 1, 4),
                   "wall_error_shipped": round(pred_shipped / timings.ratio(label).median - 1, 4),
                   "wall_error_fitted": round(pred_fit / timings.ratio(label).median - 1, 4)}
            rows.append(row)
            table.add_row(name, label, role, str(measured), str(timings.ratio(label)),
                          f"{pred_shipped:.2f}", f"{100 * row['error_shipped']:+.0f}%",
                          f"{pred_fit:.2f}", f"{100 * row['error_fitted']:+.0f}%")
    console.print(table)
    held = [r for r in rows if r["role"] == "held out"]
    mae = {k: float(np.mean([abs(r[k]) for r in held]))
           for k in ("error_shipped", "error_fitted", "wall_error_shipped", "wall_error_fitted")}
    fit = {"launch_s_shipped": shipped, "launch_s_fitted_from_cpu_ratios": launch,
           "launch_s_fitted_from_wall_ratios": wall_launch,
           "launch_s_fitted_from_cpu_seconds": abs_launch,
           "throughput_scale_fitted_from_cpu_seconds": abs_scale,
           **{f"held_out_mean_abs_{k}": round(v, 4) for k, v in mae.items()},
           "calibration": f"{CALIBRATION_MODEL} plain step at "
                          f"{[BATCH // k['micro_batch_size'] for k in CALIBRATION]} micro-batches"
                          " vs 1"}
    console.print(
        f"fitted CPU per-op overhead (CPU-time ratios, F and B as shipped): {launch * 1e6:.1f} us "
        f"(shipped {shipped * 1e6:.0f} us; from wall-time ratios {wall_launch * 1e6:.1f} us); "
        f"held-out mean |error| {100 * mae['error_shipped']:.0f}% -> "
        f"{100 * mae['error_fitted']:.0f}% (wall: {100 * mae['wall_error_shipped']:.0f}% -> "
        f"{100 * mae['wall_error_fitted']:.0f}%). From absolute CPU seconds: L = "
        f"{abs_launch * 1e6:.1f} us with the FLOP/byte terms x{abs_scale:.2f}")
    for name, (t, _) in results.items():
        console.print(f"{name} control (plain vs plain): {t.ratio(CONTROL, clock='cpu')} CPU "
                      f"time, {t.ratio(CONTROL)} wall")
    config = {"batch": BATCH, "models": {n: MODELS[n][0] for n in results},
              "seq_len": QUICK_SEQ_LEN if args.quick else {n: MODELS[n][1] for n in results},
              "calibration": CALIBRATION, "held_out": held_out, "rounds": rounds,
              "quick": args.quick, "threads": torch.get_num_threads(), "cpu_spec": {
                  "peak_fp32_flops_at_these_threads": predictor.spec.peak_fp32_flops,
                  "memory_bandwidth_bytes_per_s": predictor.spec.memory_bandwidth_bytes_per_s},
              "fit": fit, "timing": {n: t.summary() for n, (t, _) in results.items()},
              "machine_note": _record.SHARED_MACHINE_NOTE,
              "wall_seconds": round(time.perf_counter() - start, 1)}
    path = _record.write("time_model_calibration" + ("-quick" if args.quick else ""), config, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
