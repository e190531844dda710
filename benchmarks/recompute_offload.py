"""Recompute and offload, side by side in one run: for two zoo models, the device peak, the
host bytes, the extra FLOPs (FlopCounterMode, exact) and the step-time ratio of each setting
against the plain step.

    python benchmarks/recompute_offload.py [--repeats 3]

On this CPU-only machine "host" and "device" are the same memory: the split is memfit's
accounting (host_allocations), and offload's copies cost real time without hiding behind
compute; the GPU part of the story is in benchmarks/gpu_check.py.
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
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402

import _record  # noqa: E402

MODELS = [("gpt2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, bos_token_id=0,
                        eos_token_id=0), 8, 256),
          ("llama-1b", dict(num_hidden_layers=6, hidden_size=256, intermediate_size=1024,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0), 8, 256)]
SETTINGS = [dict(), dict(checkpoint="all"), dict(checkpoint="every:2"),
            dict(checkpoint="selective"), dict(offload="all"),
            dict(checkpoint="all", offload="all"), dict(offload_optimizer=True)]


def run_setting(spec, overrides, bs, seq, knobs, repeats):
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
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.run(prepared)
        times.append(time.perf_counter() - start)
    runner.close()
    return t.peak_bytes, t.host_peak_bytes, flops.get_total_flops(), min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per setting (min is kept)")
    args = ap.parse_args()
    console = Console(width=150)
    rows = []
    for name, overrides, bs, seq in MODELS:
        spec = zoo.get(name)
        table = Table(title=f"{name} (6 layers, width 256), batch {bs} x {seq}, AdamW, fp32")
        for col in ("setting", "device peak", "peak ratio", "host peak", "extra FLOPs",
                    "step s", "time ratio"):
            table.add_column(col, justify="right")
        base = None
        for knobs in SETTINGS:
            label = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "plain"
            try:
                with console.status(f"{name}: {label}"):
                    peak, host, flops, seconds = run_setting(spec, overrides, bs, seq, knobs,
                                                             args.repeats)
            except ValueError as e:          # a knob this version does not have yet
                console.print(f"[yellow]{name} {label}: skipped: {e}[/yellow]")
                continue
            base = base or (peak, flops, seconds)
            row = {"model": name, "setting": label, "peak_bytes": peak, "host_peak_bytes": host,
                   "flops": flops, "extra_flops": flops - base[1], "step_seconds": round(seconds, 4),
                   "peak_ratio": round(peak / base[0], 4), "time_ratio": round(seconds / base[2], 4)}
            rows.append(row)
            table.add_row(label, memfit.format_bytes(peak), f"{row['peak_ratio']:.3f}",
                          memfit.format_bytes(host), f"{row['extra_flops'] / 1e9:+.2f} G",
                          f"{seconds:.3f}", f"{row['time_ratio']:.2f}")
        console.print(table)
    path = _record.write("recompute_offload", {"models": MODELS, "settings": SETTINGS,
                                               "repeats": args.repeats}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
