"""The Hugging Face Trainer integration, side by side in one run: for each model, memfit's
predicted peak of a steady-state optimizer step of ``trainer.train()`` against the measured
one (``MemfitCallback``: a ``memfit.track`` over the real steps), for the trainer as configured
and after ``fit(trainer, budget)``, and the planned run's step time against the unplanned one.

    python benchmarks/integrations.py [--rounds 3] [--quick] [--fraction 0.75]

The budget is ``--fraction`` of the unplanned step's predicted peak. Two plans: memfit's own
choice (on a CPU target moving the optimizer state to the host costs no time, so it is
chosen), and the best plan that keeps the optimizer on the device (recompute / micro-batches).
Step times: every setting runs ``trainer.train()`` for ``--steps`` optimizer steps once per
round, interleaved (benchmarks/_timing.py: balanced order, ratios to the unplanned run of the
same round, median over rounds), with a second unplanned trainer as the control; one torch
thread, so the CPU-time ratios leave out the waits for a core that other jobs hold. A round's
time includes what ``train()`` does once per call (the dataloader, accelerate's prepare), alike
for every setting. On this CPU-only machine "host" and "device" are the same memory.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from transformers import PrinterCallback, Trainer, TrainingArguments  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402
from memfit.integrations import transformers as mf_hf  # noqa: E402

import _record  # noqa: E402
from _side_by_side import print_predicted_vs_measured  # noqa: E402
from _timing import CONTROL, interleave  # noqa: E402

MODELS = [("gpt2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, bos_token_id=0,
                        eos_token_id=0), 8, 256),
          ("llama-1b", dict(num_hidden_layers=6, hidden_size=256, intermediate_size=1024,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=8192,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0), 8, 256)]
QUICK_SEQ_LEN = 128


def dataset(spec, model, n: int, seq: int) -> list[dict]:
    """``n`` samples of plain lists, every row ending in padding (a mask with zeros: the
    estimate is exact, _hf_step Note 5)."""
    b = spec.make_batch(model, n, seq_len=seq, padded=True, seed=0)
    b["attention_mask"][:, -1] = 0
    b["labels"] = b["labels"].masked_fill(b["attention_mask"] == 0, -100)
    return [{k: v[i].tolist() for k, v in b.items()} for i in range(n)]


def make_trainer(spec, overrides, bs, seq, steps) -> Trainer:
    torch.manual_seed(0)
    model = spec.build(seed=0, **overrides)
    args = TrainingArguments(tempfile.mkdtemp(prefix="memfit-bench-"),
                             per_device_train_batch_size=bs, max_steps=steps, report_to="none",
                             save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True, optim="adamw_torch")
    trainer = Trainer(model=model, args=args,
                      train_dataset=dataset(spec, model, bs * (steps + 2), seq))
    trainer.remove_callback(PrinterCallback)      # no metrics printed after every train()
    return trainer


def measured(trainer, predicted) -> int:
    """The peak of step 2 of a real ``train()``, by ``MemfitCallback``."""
    cb = mf_hf.MemfitCallback(predicted=predicted, steps=2)
    trainer.add_callback(cb)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.remove_callback(cb)
    return cb.records[1].measured_peak_bytes


def run_model(name, overrides, bs, seq, steps, rounds, fraction, console):
    spec = zoo.get(name)
    plain = make_trainer(spec, overrides, bs, seq, steps)
    with console.status(f"{name}: estimating the trainer as configured"):
        est = mf_hf.estimate(plain)
    budget = int(est.peak_bytes * fraction)
    settings = {"as configured": (plain, est, None)}
    for label, fixed in (("fit", {}), ("fit, optimizer on device", {"offload_optimizer": False})):
        trainer = make_trainer(spec, overrides, bs, seq, steps)
        with console.status(f"{name}: {label} under {memfit.format_bytes(budget)}"):
            changes = mf_hf.fit(trainer, budget, verbose=False, **fixed)
        settings[label] = (trainer, changes.estimate, changes)
    rows = []
    for label, (trainer, predicted, changes) in settings.items():
        with console.status(f"{name}: measuring {label}"):
            peak = measured(trainer, predicted)
        rows.append({"model": name, "setting": label, "budget_bytes": budget,
                     "predicted_peak_bytes": predicted.peak_bytes, "measured_peak_bytes": peak,
                     "predicted_minus_measured_bytes": predicted.peak_bytes - peak,
                     "plan": changes.candidate.describe() if changes else "as configured",
                     "predicted_step_time_ratio": round(changes.predicted_step_time_ratio, 4)
                     if changes else 1.0})
    control = make_trainer(spec, overrides, bs, seq, steps)
    trainers = {label: s[0] for label, s in settings.items()} | {CONTROL: control}
    steps_of = {label: (lambda t=t: t.train()) for label, t in trainers.items()}
    with console.status(f"{name}: timing {len(steps_of)} settings interleaved") as status:
        timings = interleave(steps_of, rounds, "as configured", warmup=1,
                             on_round=lambda r, n: status.update(
                                 f"{name}: timing, round {r + 1}/{n}"))
    print_predicted_vs_measured(
        console, f"{name} (6 layers, width 256), Trainer batch {bs} x {seq}, AdamW, fp32, "
        f"budget {memfit.format_bytes(budget)} ({fraction:.0%} of the plain "
        f"step); time: {steps} steps per round, median [quartiles] of {rounds}",
        rows, timings, "as configured vs a second unplanned trainer")
    return rows, {"model": name, **timings.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds (default 3, --quick 2)")
    ap.add_argument("--steps", type=int, default=6,
                    help="optimizer steps per train() call, per round (default 6)")
    ap.add_argument("--fraction", type=float, default=0.75,
                    help="the budget as a fraction of the unplanned step's peak (default 0.75)")
    ap.add_argument("--quick", action="store_true",
                    help=f"gpt2 only, sequence {QUICK_SEQ_LEN}: a few minutes")
    args = ap.parse_args()
    rounds = args.rounds or (2 if args.quick else 3)
    if rounds < 1 or args.steps < 2 or not 0 < args.fraction < 1:
        ap.error("needs --rounds >= 1, --steps >= 2 and 0 < --fraction < 1")
    torch.set_num_threads(1)          # 2 threads fighting other jobs for 2 cores: noise
    transformers.logging.set_verbosity_error()
    console = Console(width=160)
    models = [(n, o, b, QUICK_SEQ_LEN) for n, o, b, _ in MODELS[:1]] if args.quick else MODELS
    rows, timing = [], []
    for name, overrides, bs, seq in models:
        r, t = run_model(name, overrides, bs, seq, args.steps, rounds, args.fraction, console)
        rows += r
        timing.append(t)
    path = _record.write("integrations" + ("-quick" if args.quick else ""),
                         {"integration": "transformers.Trainer", "models": models,
                          "rounds": rounds, "steps": args.steps, "fraction": args.fraction,
                          "quick": args.quick, "accelerate": _accelerate_version(),
                          "timing": timing, "machine_note": _record.SHARED_MACHINE_NOTE}, rows)
    console.print(f"recorded in {path}")


def _accelerate_version() -> str:
    import accelerate
    return accelerate.__version__


if __name__ == "__main__":
    main()
