"""Peak memory and step time vs micro-batch size and precision, for two zoo models, measured
side by side in one run on this machine, as ratios to the plain step (fp32, whole batch).

    python benchmarks/precision_accumulation.py [--rounds 5] [--quick]

Each setting gets its own runner (same seed, same weights); peaks are measured one setting at a
time (``memfit.track``), then all the runners' steps are timed interleaved (benchmarks/_timing.py:
every setting once per round, balanced order, the ratio to the plain step of the same round,
median over rounds, quartiles as the spread), with a second plain runner as the control (its
ratio should read 1.00x; how far it is off is the noise left on this shared machine). One torch
thread: the CPU-time ratios (process CPU time per step) leave out the waits for a core that
other jobs hold, and are the steadier figure on a loaded machine.

CPU note: bf16/fp16 autocast on a CPU without native bf16/fp16 matmuls is usually *slower*
than fp32; the memory ratios carry over to GPUs, the time ratios do not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402

import _record  # noqa: E402
from _timing import CONTROL, interleave  # noqa: E402

# Real architectures at a width this 2-core machine steps through in seconds.
MODELS = [("gpt2", dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, bos_token_id=0,
                        eos_token_id=0), 8, 128),
          ("bert-base", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                             intermediate_size=1024, vocab_size=8192), 8, 128)]
SETTINGS = [(p, m) for p in ("fp32", "bf16", "fp16", "bf16-pure") for m in (8, 4, 2, 1)]
# --quick: one model, fp32 at every micro-batch and bf16 at one: a CPU without AVX512-BF16 /
# AVX512-FP16 runs 16-bit matmuls 10-60x slower than fp32 (the record's cpu_flags say which)
QUICK_SETTINGS = [("fp32", m) for m in (8, 4, 2, 1)] + [("bf16", 8)]
QUICK_SEQ_LEN = 64


def build(spec, overrides, bs, seq, precision, mbs):
    """A runner of one setting, one step taken (steady state), its tracked peak."""
    torch.manual_seed(0)
    model = spec.build(seed=0, **overrides)
    batch = spec.make_batch(model, bs, seq_len=seq, padded=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    runner = memfit.fit(model, opt, batch, precision=precision, micro_batch_size=mbs)
    runner.step(batch)
    with memfit.track(runner.model, runner.optimizer) as t:
        runner.step(batch)
    return runner, batch, t.peak_bytes


def label_of(precision: str, mbs: int) -> str:
    return f"{precision}, micro-batch {mbs}"


def run_model(name, overrides, bs, seq, settings, rounds, console):
    spec = zoo.get(name)
    runners, steps, peaks = [], {}, {}
    # every setting, then a second plain runner (the first setting) as the control
    for label, (precision, mbs) in [*((label_of(*s), s) for s in settings),
                                    (CONTROL, settings[0])]:
        with console.status(f"{name}: building {label}"):
            runner, batch, peaks[label] = build(spec, overrides, bs, seq, precision, mbs)
        runners.append(runner)
        steps[label] = (lambda r=runner, b=batch: r.step(b))
    base = label_of(*settings[0])
    with console.status(f"{name}: timing {len(steps)} settings interleaved") as status:
        timings = interleave(steps, rounds, base, warmup=1, on_round=lambda r, n: status.update(
            f"{name}: timing {len(steps)} settings interleaved, round {r + 1}/{n}"))
    for runner in runners:
        runner.close()
    table = Table(title=f"{name} ({overrides}), batch {bs} x {seq}, AdamW: ratios to fp32 / "
                        f"whole batch (time: median [quartiles] of {rounds} interleaved rounds)")
    for col in ("precision", "micro-batch", "peak", "peak ratio", "step s", "time ratio",
                "CPU-time ratio"):
        table.add_column(col, justify="right")
    rows = []
    for precision, mbs in [*settings, (None, None)]:
        label = CONTROL if precision is None else label_of(precision, mbs)
        ratio = timings.ratio(label)
        row = {"model": name, "setting": label, "precision": precision or settings[0][0],
               "micro_batch_size": mbs or settings[0][1], "peak_bytes": peaks[label],
               "peak_ratio": round(peaks[label] / peaks[base], 4), **timings.row(label)}
        rows.append(row)
        table.add_row(precision or CONTROL, str(mbs or settings[0][1]),
                      memfit.format_bytes(peaks[label]), f"{row['peak_ratio']:.3f}",
                      f"{timings.median_s(label):.3f}", str(ratio),
                      str(timings.ratio(label, clock="cpu")))
    console.print(table)
    return rows, {"model": name, **timings.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds, one step per setting each (default 5, "
                         "--quick 3)")
    ap.add_argument("--quick", action="store_true",
                    help=f"gpt2 only, sequence {QUICK_SEQ_LEN}, {len(QUICK_SETTINGS)} settings "
                         "(fp32, and bf16 at the whole batch), 3 rounds: a few minutes")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 5)
    if rounds < 1:
        ap.error(f"--rounds {rounds}: needs at least 1")
    torch.set_num_threads(1)          # 2 threads fighting other jobs for 2 cores: noise
    console = Console(width=140)
    models = [(n, o, b, QUICK_SEQ_LEN) for n, o, b, _ in MODELS[:1]] if args.quick else MODELS
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    rows, timing = [], []
    for name, overrides, bs, seq in models:
        r, t = run_model(name, overrides, bs, seq, settings, rounds, console)
        rows += r
        timing.append(t)
        c = r[-1]
        console.print(f"control (plain vs plain): {c['time_ratio']:.2f}x "
                      f"[{c['time_ratio_q1']:.2f}-{c['time_ratio_q3']:.2f}] wall, "
                      f"{c['cpu_time_ratio']:.2f}x [{c['cpu_time_ratio_q1']:.2f}-"
                      f"{c['cpu_time_ratio_q3']:.2f}] CPU time")
    path = _record.write("precision_accumulation" + ("-quick" if args.quick else ""),
                         {"models": models, "settings": settings, "rounds": rounds,
                          "quick": args.quick, "timing": timing,
                          "machine_note": _record.SHARED_MACHINE_NOTE}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
