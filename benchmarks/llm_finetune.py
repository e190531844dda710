"""Fine-tuning an 8B-class LLM on one card: memfit's predicted device bytes for full fine-tuning,
LoRA, QLoRA, and QLoRA with the loss in pieces and a paged 8-bit AdamW, beside what
``accelerate estimate-memory``'s formula gives for the same model (issue 28).

    python benchmarks/llm_finetune.py [--models llama-3.1-8b,qwen2.5-7b]
        [--cards rtx-4090,rtx-4060-ti-16gb] [--seq-len 2048]

The models are built on ``meta`` from their config.json (benchmarks/configs/, as the hub serves
them), every run with bf16 autocast, gradient checkpointing on every block, one sequence of
``--seq-len`` tokens, LoRA rank 16 on every linear layer (alpha 32). accelerate's formula
(``accelerate.commands.estimate``) counts the parameters alone: "training using Adam" in bf16 is
twice the fp32 weights, whatever is trained or quantized; it has no figure for QLoRA (its int4
row is the weights' load size). memfit's are whole-step predictions (weights, quantization
state, adapters, optimizer state, activations, temporaries, the allocator, the CUDA context),
unvalidated on a GPU until benchmarks/gpu_check.py runs there. The float weights are fp32 (as
memfit builds a config; a base loaded in bf16 holds half), the 4-bit base's other weights too (as
peft's ``prepare_model_for_kbit_training`` leaves them). "qlora+chunked+8bit" is bitsandbytes'
8-bit AdamW (``optimizer_state="8bit"``), "qlora+chunked+paged8bit" the user's own
``bnb.optim.PagedAdamW8bit``, whose large moments live in unified memory: counted on the card,
on a line of their own (``unified_memory_bytes`` in the record), outside the allocator.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import peft  # noqa: E402
from accelerate.commands.estimate import estimate_training_usage  # noqa: E402
from accelerate.utils import calculate_maximum_sizes  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import memfit  # noqa: E402
from memfit import zoo  # noqa: E402
from memfit.techniques import QuantizedBase  # noqa: E402
from memfit.units import format_bytes  # noqa: E402

import _record  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
RUNS = ("full", "lora", "qlora", "qlora+chunked+8bit", "qlora+chunked+paged8bit")


def build(name: str, run: str):
    """(spec, the model to train, accelerate's figures for its float base)."""
    spec = zoo.from_config_file(CONFIGS / f"{name}.json", task="causal-lm")
    model = spec.build("causal-lm", device="meta")
    acc = accelerate_figures(model)          # before anything is frozen or quantized
    if run != "full":
        model.requires_grad_(False)
        if run.startswith("qlora"):
            QuantizedBase(QuantizedBase.Config("nf4")).apply(model)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, target_modules="all-linear", task_type=peft.TaskType.CAUSAL_LM))
    return spec, model, acc


def knobs(run: str) -> dict:
    out = {"precision": "bf16", "checkpoint": "all"}
    if run.startswith("qlora+chunked"):
        out["chunked_loss"] = 8
    if run == "qlora+chunked+8bit":
        out["optimizer_state"] = "8bit"
    return out


def optimizer(run: str):
    """The run's optimizer: bitsandbytes' paged 8-bit AdamW as a user builds it, else AdamW."""
    if run.endswith("paged8bit"):
        import bitsandbytes as bnb
        return lambda params: bnb.optim.PagedAdamW8bit(params, lr=2e-4)
    return "adamw"


def accelerate_figures(float_model) -> dict:
    """accelerate estimate-memory's figures for the float model (its own functions)."""
    total, _ = calculate_maximum_sizes(float_model)
    return {"accelerate_bf16_adam_bytes": int(max(estimate_training_usage(total, "bfloat16")
                                                  .values())),
            "accelerate_int4_load_bytes": int(total / 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b")
    ap.add_argument("--cards", default="rtx-4090,rtx-4060-ti-16gb")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--runs", default=",".join(RUNS))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for name in args.models.split(","):
        for run in args.runs.split(","):
            spec, model, acc = build(name, run)
            batch = spec.make_batch(model.get_base_model() if run != "full" else model, 1,
                                    seq_len=args.seq_len)
            for card in args.cards.split(","):
                start = time.perf_counter()
                est = memfit.estimate(memfit.Job(model, batch, optimizer=optimizer(run)),
                                      device=card, **knobs(run))
                rows.append({"model": name, "run": run, "card": card,
                             "memfit_device_bytes": est.device_bytes, "fits": est.fits,
                             "usable_bytes": est.device.usable_bytes,
                             "breakdown": est.breakdown, "knobs": knobs(run),
                             "unified_memory_bytes": est.card.unified_memory_bytes,
                             "trace_seconds": round(time.perf_counter() - start, 1), **acc})
                print(f"{name} {run} {card}: {format_bytes(est.device_bytes)}", flush=True)
    table = Table(title=f"one sequence of {args.seq_len} tokens, bf16, checkpointing, LoRA r16")
    for col in ("model", "run", "card", "memfit (device)", "fits", "accelerate bf16 Adam",
                "accelerate int4 load"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["model"], r["run"], r["card"], format_bytes(r["memfit_device_bytes"]),
                      "yes" if r["fits"] else "no", format_bytes(r["accelerate_bf16_adam_bytes"]),
                      format_bytes(r["accelerate_int4_load_bytes"]))
    Console().print(table)
    path = _record.write("llm_finetune", {"seq_len": args.seq_len, "models": args.models,
                                          "cards": args.cards, "runs": args.runs}, rows)
    print(f"recorded in {path}")


if __name__ == "__main__":
    main()
