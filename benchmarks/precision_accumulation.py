"""Peak memory and step time vs micro-batch size and precision, for two zoo models, measured
side by side in one run on this machine, as ratios to the plain step (fp32, whole batch).

    python benchmarks/precision_accumulation.py [--repeats 3]

CPU note: bf16/fp16 autocast on a CPU without native bf16/fp16 matmuls is usually *slower*
than fp32; the memory ratios carry over to GPUs, the time ratios do not.
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

import _record  # noqa: E402

# Real architectures at a width this 2-core machine steps through in seconds.
MODELS = [("gpt2", dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, bos_token_id=0,
                        eos_token_id=0), 8, 128),
          ("bert-base", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                             intermediate_size=1024, vocab_size=8192), 8, 128)]
SETTINGS = [(p, m) for p in ("fp32", "bf16", "fp16", "bf16-pure") for m in (8, 4, 2, 1)]


def measure(spec, overrides, bs, seq, precision, mbs, repeats):
    torch.manual_seed(0)
    model = spec.build(seed=0, **overrides)
    batch = spec.make_batch(model, bs, seq_len=seq, padded=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runner = memfit.fit(model, opt, batch, precision=precision, micro_batch_size=mbs)
    runner.step(batch)                             # steady state
    with memfit.track(runner.model, runner.optimizer) as t:
        runner.step(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.step(batch)
        times.append(time.perf_counter() - start)
    return t.peak_bytes, min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per setting (min is kept)")
    args = ap.parse_args()
    console = Console(width=140)
    rows = []
    for name, overrides, bs, seq in MODELS:
        spec = zoo.get(name)
        table = Table(title=f"{name} ({overrides}), batch {bs} x {seq}, AdamW: ratios to fp32 / whole batch")
        for col in ("precision", "micro-batch", "peak", "peak ratio", "step s", "time ratio"):
            table.add_column(col, justify="right")
        base = None
        for precision, mbs in SETTINGS:
            with console.status(f"{name}: {precision}, micro-batch {mbs}"):
                peak, seconds = measure(spec, overrides, bs, seq, precision, mbs, args.repeats)
            base = base or (peak, seconds)
            row = {"model": name, "precision": precision, "micro_batch_size": mbs,
                   "peak_bytes": peak, "step_seconds": round(seconds, 4),
                   "peak_ratio": round(peak / base[0], 4), "time_ratio": round(seconds / base[1], 4)}
            rows.append(row)
            table.add_row(precision, str(mbs), memfit.format_bytes(peak), f"{row['peak_ratio']:.3f}",
                          f"{seconds:.3f}", f"{row['time_ratio']:.2f}")
        console.print(table)
    path = _record.write("precision_accumulation", {"models": MODELS, "settings": SETTINGS,
                                                    "repeats": args.repeats}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
