"""The Accelerate integration, side by side in one run: memfit's predicted peak of a
steady-state optimizer step of a user's Accelerate loop against the measured one (``memfit.track``
over the real loop, the window on its third optimizer step), unplanned and after
``fit(accelerator, model, optimizer, batch, budget)``, and the planned loop's step time against
the unplanned one.

    python benchmarks/integrations_accelerate.py [--rounds 3] [--steps 4] [--fraction 0.75]

The loop is the one the Accelerate docs show (``accumulate``, ``backward``, the prepared
optimizer), gradient accumulation 2. The budget is ``--fraction`` of the unplanned step's
predicted peak; two plans: memfit's own choice, and the best one that keeps the optimizer on
the device. Step times are interleaved (benchmarks/_timing.py) with a second unplanned loop
as the control; one torch thread (CPU-time ratios leave out waits for a core). On this CPU-only
machine "host" and "device" are the same memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import accelerate  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from rich.console import Console  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402
from memfit.integrations import accelerate as mf_acc  # noqa: E402
from memfit.step import prepare_batch  # noqa: E402

from _side_by_side import time_print_and_record  # noqa: E402
from _timing import CONTROL  # noqa: E402

MODEL = ("gpt2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, bos_token_id=0,
                      eos_token_id=0), 8, 128)
ACCUMULATION = 2


def prepared(accelerator, spec, overrides, bs, seq):
    """A fresh model, AdamW and batch, prepared by ``accelerator``."""
    torch.manual_seed(0)
    model = spec.build(seed=0, **overrides)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, prepare_batch(spec.make_batch(model, bs, seq_len=seq, seed=0))


def loop(accelerator, model, optimizer, batch, steps: int):
    """The user's loop: ``steps`` optimizer steps."""
    for _ in range(steps * ACCUMULATION):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()


def measured(accelerator, model, optimizer, batch) -> int:
    """The peak of the third optimizer step of the real loop (the steady state)."""
    with memfit.track(model, optimizer.optimizer) as t:
        loop(accelerator, model, optimizer, batch, 2)
        t.start_window()
        loop(accelerator, model, optimizer, batch, 1)
    return t.peak_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    ap.add_argument("--steps", type=int, default=4,
                    help="optimizer steps per timed loop, per round (default 4)")
    ap.add_argument("--fraction", type=float, default=0.9,
                    help="the budget as a fraction of the unplanned step's peak (default 0.9: "
                         "the LM head's logits, outside the blocks, set the floor near 0.87)")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1 or not 0 < args.fraction < 1:
        ap.error("needs --rounds >= 1, --steps >= 1 and 0 < --fraction < 1")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    console = Console(width=160)
    name, overrides, bs, seq = MODEL
    spec = zoo.get(name)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    plain = prepared(accelerator, spec, overrides, bs, seq)
    with console.status("estimating the unplanned loop"):
        est = mf_acc.estimate(accelerator, *plain)
    budget = int(est.peak_bytes * args.fraction)
    settings = {"unplanned": (plain, est.peak_bytes, "as written", 1.0)}
    for label, fixed in (("fit", {}), ("fit, optimizer on device", {"offload_optimizer": False})):
        loop_parts = prepared(accelerator, spec, overrides, bs, seq)
        try:
            with console.status(f"{label} under {memfit.format_bytes(budget)}"):
                changes = mf_acc.fit(accelerator, *loop_parts, budget, verbose=False, **fixed)
        except memfit.BudgetTooSmall as e:
            console.print(f"{label}: no plan fits ({e.floor_bytes} B is the least)")
            continue
        modes = sorted({m for m in changes.blocks.values() if m != "keep"})
        what = ", ".join([f"{sum(m != 'keep' for m in changes.blocks.values())} blocks "
                          f"{'/'.join(modes)}"] * bool(modes)
                         + ["optimizer on the host"] * changes.optimizer_offloaded) or "nothing"
        settings[label] = (loop_parts, changes.predicted_peak_bytes, what,
                           changes.plan.predicted_step_time_ratio)
    rows = []
    for label, (parts, predicted, what, ratio) in settings.items():
        with console.status(f"measuring {label}"):
            peak = measured(accelerator, *parts)
        rows.append({"setting": label, "plan": what, "budget_bytes": budget,
                     "predicted_peak_bytes": predicted, "measured_peak_bytes": peak,
                     "predicted_minus_measured_bytes": predicted - peak,
                     "predicted_step_time_ratio": round(ratio, 4)})
    control = prepared(accelerator, spec, overrides, bs, seq)
    loops = {label: s[0] for label, s in settings.items()} | {CONTROL: control}
    steps_of = {label: (lambda p=p: loop(accelerator, *p, args.steps))
                for label, p in loops.items()}
    time_print_and_record(
        console, "integrations-accelerate", steps_of, args,
        f"Accelerate loop: {name} (6 layers, width 256), batch {bs} x {seq}, "
        f"accumulation {ACCUMULATION}, AdamW fp32, budget "
        f"{memfit.format_bytes(budget)} ({args.fraction:.0%} of the unplanned "
        f"step); time: {args.steps} steps per round, median [quartiles] of "
        f"{args.rounds}",
        rows, "unplanned vs a second unplanned loop",
        {"integration": "accelerate", "model": [name, overrides, bs, seq],
         "accumulation": ACCUMULATION, "accelerate": accelerate.__version__})


if __name__ == "__main__":
    main()
