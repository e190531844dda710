"""The Lightning integration, side by side in one run: ``MemfitPlan``'s predicted peak of a
steady-state optimizer step of a real ``lightning.Trainer.fit`` against the one it measures
(a ``memfit.track`` over the real steps, step 2 on), without a budget and with one, and the
planned run's time against the unplanned one.

    python benchmarks/integrations_lightning.py [--rounds 3] [--steps 4] [--fraction 0.8]

A tiny-vocabulary GPT-2 (6 layers, width 256) wrapped in a LightningModule as users do, batch
8 x 256, ``accumulate_grad_batches=2`` (each block runs two passes per optimizer step:
planner memory_model Note 8), AdamW fp32; the budget is ``--fraction`` of the unplanned step's
predicted peak. The plan keeps the optimizer on the device (an optimizer the
strategy rebuilds at every ``fit`` would leave the offloaded one behind), so it stays applied to
the module after its ``fit`` (block hooks; ``_lightning_callback`` Note 2) and the timed runs
are plain ``Trainer.fit`` calls of ``--steps`` steps on the planned and the unplanned module,
interleaved (benchmarks/_timing.py) with a second unplanned module as the control; one torch
thread. Each timed run includes ``fit``'s own setup, alike for every setting.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from rich.console import Console  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import default_data_collator  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402
from memfit.integrations import lightning as mf_pl  # noqa: E402

from _side_by_side import time_print_and_record  # noqa: E402
from _timing import CONTROL  # noqa: E402

OVERRIDES = dict(n_layer=6, n_embd=256, n_head=4, vocab_size=512, bos_token_id=0, eos_token_id=0)
BATCH, SEQ, ACCUMULATION = 8, 256, 2


class Wrapped(L.LightningModule):
    """A Hugging Face model as users wrap one."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def module_and_loader(samples: int):
    spec = zoo.get("gpt2")
    torch.manual_seed(0)
    model = spec.build(seed=0, **OVERRIDES)
    b = spec.make_batch(model, samples, seq_len=SEQ, seed=0)
    rows = [{k: v[i].tolist() for k, v in b.items() if k != "attention_mask"}
            for i in range(samples)]
    loader = DataLoader(rows, batch_size=BATCH, collate_fn=default_data_collator)
    return Wrapped(model), loader


def fit(module, loader, steps: int, callbacks=()):
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, accumulate_grad_batches=ACCUMULATION,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)


def measured(module, loader, **kw) -> mf_pl.MemfitPlan:
    cb = mf_pl.MemfitPlan(steps=3, verbose=False, **kw)
    fit(module, loader, 3, [cb])
    return cb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    ap.add_argument("--steps", type=int, default=4,
                    help="optimizer steps per timed fit, per round (default 4)")
    ap.add_argument("--fraction", type=float, default=0.8,
                    help="the budget as a fraction of the unplanned step's peak (default 0.8)")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1 or not 0 < args.fraction < 1:
        ap.error("needs --rounds >= 1, --steps >= 1 and 0 < --fraction < 1")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    console = Console(width=160)
    samples = BATCH * ACCUMULATION * (max(args.steps, 3) + 1)
    plain, loader = module_and_loader(samples)
    with console.status("the unplanned fit: predicted vs measured"):
        unplanned = measured(plain, loader)
    budget = int(unplanned.predicted_peak_bytes * args.fraction)
    planned_module, planned_loader = module_and_loader(samples)
    with console.status(f"MemfitPlan under {memfit.format_bytes(budget)}"):
        planned = measured(planned_module, planned_loader, budget=budget, offload_optimizer=False)
    changes = planned.changes
    modes = sorted({m for m in changes.blocks.values() if m != "keep"})
    what = (f"{sum(m != 'keep' for m in changes.blocks.values())} blocks {'/'.join(modes)}"
            if modes else "nothing")
    rows = []
    for label, cb, plan, ratio in (
            ("unplanned", unplanned, "as written", 1.0),
            ("MemfitPlan", planned, what, changes.plan.predicted_step_time_ratio)):
        peak = max(r.measured_peak_bytes for r in cb.records[1:])       # steps 2.. (Note 3)
        rows.append({"setting": label, "plan": plan, "budget_bytes": budget,
                     "predicted_peak_bytes": cb.predicted_peak_bytes, "measured_peak_bytes": peak,
                     "predicted_minus_measured_bytes": cb.predicted_peak_bytes - peak,
                     "predicted_step_time_ratio": round(ratio, 4)})
    control, control_loader = module_and_loader(samples)
    runs = {"unplanned": (plain, loader), "MemfitPlan": (planned_module, planned_loader),
            CONTROL: (control, control_loader)}
    steps_of = {label: (lambda m=m, d=d: fit(m, d, args.steps)) for label, (m, d) in runs.items()}
    time_print_and_record(
        console, "integrations-lightning", steps_of, args,
        f"Lightning Trainer.fit: gpt2 (6 layers, width 256, vocabulary 512), "
        f"batch {BATCH} x {SEQ}, accumulate_grad_batches {ACCUMULATION}, AdamW "
        f"fp32, budget {memfit.format_bytes(budget)} ({args.fraction:.0%} of the "
        f"unplanned step); time: {args.steps} steps per fit, median [quartiles] "
        f"of {args.rounds}",
        rows, "unplanned vs a second unplanned module",
        {"integration": "lightning", "model": ["gpt2", OVERRIDES, BATCH, SEQ],
         "accumulation": ACCUMULATION, "lightning": L.__version__})


if __name__ == "__main__":
    main()
