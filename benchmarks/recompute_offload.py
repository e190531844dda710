"""Recompute and offload, side by side in one run: for two zoo models, the device peak, the
host bytes, the extra FLOPs (FlopCounterMode, exact) and the step-time ratio of each setting
against the plain step.

    python benchmarks/recompute_offload.py [--rounds 5] [--quick]

Each setting gets its own runner (same seed, same weights); peaks and FLOPs are measured one
setting at a time, then all the runners' steps are timed interleaved (benchmarks/_timing.py:
every setting once per round, balanced order, the ratio to the plain step of the same round,
median over rounds, quartiles as the spread), with a second plain runner as the control. One
torch thread: the CPU-time ratios (process CPU time per step) leave out the waits for a core
that other jobs hold, and are the steadier figure on a loaded machine.

On this CPU-only machine "host" and "device" are the same memory: the split is memfit's
accounting (host_allocations), and offload's copies cost real time without hiding behind
compute; the GPU part of the story is in benchmarks/gpu_check.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402

import _record  # noqa: E402
from _timing import CONTROL, interleave  # noqa: E402

MODELS = [("gpt2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, bos_token_id=0,
                        eos_token_id=0), 8, 256),
          ("llama-1b", dict(num_hidden_layers=6, hidden_size=256, intermediate_size=1024,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0), 8, 256)]
SETTINGS = [dict(), dict(checkpoint="all"), dict(checkpoint="every:2"),
            dict(checkpoint="selective"), dict(offload="all"),
            dict(checkpoint="all", offload="all"), dict(offload_optimizer=True)]
QUICK_SEQ_LEN = 128


def label_of(knobs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items()) or "plain"


def build(spec, overrides, bs, seq, knobs):
    """A runner of one setting (one step taken), its prepared batch, peaks and FLOPs."""
    torch.manual_seed(0)
    model = spec.build(seed=0, **overrides)
    batch = spec.make_batch(model, bs, seq_len=seq, padded=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runner = memfit.fit(model, opt, batch, **knobs)
    runner.step(batch)
    prepared = runner.prepare(batch)
    with memfit.track(runner.model, runner.optimizer) as t:
        runner.run(prepared)
    with FlopCounterMode(display=False) as flops:
        runner.run(prepared)
    return runner, prepared, (t.peak_bytes, t.host_peak_bytes, flops.get_total_flops())


def run_model(name, overrides, bs, seq, rounds, console):
    spec = zoo.get(name)
    runners, steps, measured = [], {}, {}
    for label, knobs in [*((label_of(k), k) for k in SETTINGS), (CONTROL, {})]:
        try:
            with console.status(f"{name}: building {label}"):
                runner, prepared, measured[label] = build(spec, overrides, bs, seq, knobs)
        except ValueError as e:          # a knob this version does not have yet
            console.print(f"[yellow]{name} {label}: skipped: {e}[/yellow]")
            continue
        runners.append(runner)
        steps[label] = (lambda r=runner, p=prepared: r.run(p))
    with console.status(f"{name}: timing {len(steps)} settings interleaved") as status:
        timings = interleave(steps, rounds, "plain", warmup=1, on_round=lambda r, n: status.update(
            f"{name}: timing {len(steps)} settings interleaved, round {r + 1}/{n}"))
    for runner in runners:
        runner.close()
    table = Table(title=f"{name} (6 layers, width 256), batch {bs} x {seq}, AdamW, fp32 (time: "
                        f"median [quartiles] of {rounds} interleaved rounds)")
    for col in ("setting", "device peak", "peak ratio", "host peak", "extra FLOPs",
                "step s", "time ratio", "CPU-time ratio"):
        table.add_column(col, justify="right")
    base_peak, _, base_flops = measured["plain"]
    rows = []
    for label in steps:
        peak, host, flops = measured[label]
        row = {"model": name, "setting": label, "peak_bytes": peak, "host_peak_bytes": host,
               "flops": flops, "extra_flops": flops - base_flops,
               "peak_ratio": round(peak / base_peak, 4), **timings.row(label)}
        rows.append(row)
        table.add_row(label, memfit.format_bytes(peak), f"{row['peak_ratio']:.3f}",
                      memfit.format_bytes(host), f"{row['extra_flops'] / 1e9:+.2f} G",
                      f"{timings.median_s(label):.3f}", str(timings.ratio(label)),
                      str(timings.ratio(label, clock="cpu")))
    console.print(table)
    console.print(f"control (plain vs plain): {timings.ratio(CONTROL)} wall, "
                  f"{timings.ratio(CONTROL, clock='cpu')} CPU time")
    return rows, {"model": name, **timings.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds, one step per setting each (default 5, "
                         "--quick 3)")
    ap.add_argument("--quick", action="store_true",
                    help=f"gpt2 only, sequence {QUICK_SEQ_LEN}, 3 rounds: a few minutes")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    if rounds < 1:
        ap.error(f"--rounds {rounds}: needs at least 1")
    torch.set_num_threads(1)          # 2 threads fighting other jobs for 2 cores: noise
    console = Console(width=150)
    models = [(n, o, b, QUICK_SEQ_LEN) for n, o, b, _ in MODELS[:1]] if args.quick else MODELS
    rows, timing = [], []
    for name, overrides, bs, seq in models:
        r, t = run_model(name, overrides, bs, seq, rounds, console)
        rows += r
        timing.append(t)
    path = _record.write("recompute_offload" + ("-quick" if args.quick else ""),
                         {"models": models, "settings": SETTINGS, "rounds": rounds,
                          "quick": args.quick, "timing": timing,
                          "machine_note": _record.SHARED_MACHINE_NOTE}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
