"""``memfit plan``: the fastest way to make a training step fit a GPU, and what it costs."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rich.console import Console

from memfit.cli._common import DEFAULT_GPU, add_model_args, build_model, make_batch
from memfit.cli.estimate import describe_batch
from memfit.knobs import PRECISIONS
from memfit.optimizers import OPTIMIZERS

EXPORTS = ("transformers", "accelerate", "deepspeed")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan", help="pick the fastest mix of techniques that fits the GPU (no GPU needed)",
        description="Trace the training step on fake tensors, search precision, micro-batch "
                    "size, per-block recompute / selective recompute / activation offload and "
                    "optimizer-state offload for the fastest configuration predicted to fit, and "
                    "verify it by tracing it. Default: XLM-RoBERTa-large, sequence "
                    "classification, batch 32, length 256, AdamW, precision auto, on a GTX "
                    "1080 Ti.")
    add_model_args(p, batch_size=32, lever_auto=True)
    g = p.add_argument_group("training (a flag fixes a choice; unset, memfit decides)")
    g.add_argument("--precision", default="auto", choices=PRECISIONS,
                   help="numerics of the step (default: auto: the GPU's 16-bit autocast)")
    g.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                   help="optimizer whose state is counted (default: adamw)")
    g.add_argument("--micro-batch-size", type=int, default=None, metavar="N",
                   help="fix the micro-batch size (default: memfit picks)")
    g.add_argument("--checkpoint", default=None, metavar="POLICY",
                   help="fix recompute: none, all, every:K, selective (default: memfit picks "
                        "per block)")
    g.add_argument("--offload", default=None, metavar="POLICY",
                   help="fix activation offload: none, all, every:K (default: memfit picks)")
    g.add_argument("--offload-optimizer", default=None, choices=("on", "off"),
                   help="fix where the optimizer state lives (default: memfit picks)")
    g.add_argument("--max-grad-norm", type=float, default=None, metavar="X",
                   help="clip the global gradient norm at X (counted in the optimizer step)")
    g = p.add_argument_group("target and output")
    g.add_argument("--gpu", default=DEFAULT_GPU, metavar="NAME",
                   help=f"GPU to plan for, or 'cpu' (default: {DEFAULT_GPU})")
    g.add_argument("--budget", default=None, metavar="BYTES",
                   help="device bytes to fit, e.g. 10GiB (default: the GPU's usable memory)")
    g.add_argument("--export", default=None, choices=EXPORTS,
                   help="also print the plan as Hugging Face TrainingArguments keywords, an "
                        "Accelerate config or a DeepSpeed config")
    g.add_argument("--what-if", action="store_true",
                   help="also print peak memory as sequence length, hidden size and layer "
                        "count shrink (the plain step at the plan's precision)")
    g.add_argument("--progressive", default=None, metavar="LEN[:FRACTION]",
                   help="also size a progressive schedule: FRACTION of the steps (default 0.9) "
                        "at length LEN, the rest at full length, each phase planned to fit")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write live bytes over the step before (plain) and after (planned), "
                        "with the budget line")
    p.set_defaults(run=run)
    return p


def _knobs(args) -> dict:
    oo = {"on": True, "off": False}.get(args.offload_optimizer)
    return dict(precision=args.precision, micro_batch_size=args.micro_batch_size,
                checkpoint=args.checkpoint, offload=args.offload, offload_optimizer=oo,
                max_grad_norm=args.max_grad_norm)


def run(args) -> int:
    from memfit.api.plan import plan_traced

    console = Console(stderr=args.json)
    start = time.perf_counter()
    out: dict = {}
    with console.status("building the model on the meta device...") as status:
        spec, model = build_model(args)
        batch_size, seq_len = _resolve_levers(spec, model, args, status, out)
        batch = make_batch(spec, model, args, batch_size, seq_len)
        planned = plan_traced(model, batch, args.budget, args.optimizer, args.gpu,
                              on_progress=lambda m: status.update(m + "..."), **_knobs(args))
        extras = _extras(spec, model, batch, args, status, planned.plan, out)
    p, seconds = planned.plan, time.perf_counter() - start
    described = describe_batch(batch)
    if args.plot:
        from memfit.report import plot_before_after

        plot_before_after(args.plot, planned.plain, planned.chosen, limit_bytes=p.budget_bytes,
                          titles=(f"plain step ({p.knobs.precision})", "with the plan"),
                          suptitle=f"{spec.name}, {described}, {args.optimizer}, {p.device}")
    if args.json:
        out.update({"model": spec.name, "task": args.task or spec.default_task,
                    "batch": {k: list(v.shape) for k, v in batch.items()},
                    "optimizer": args.optimizer, "plain_device_bytes": planned.plain.device_bytes,
                    "plan": json.loads(p.to_json()), "validated": planned.chosen.validated,
                    "seconds": round(seconds, 2)})
        if args.plot:
            out["plot"] = args.plot
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    _print_human(console, spec, planned, described, args, seconds, extras)
    return 0


def _resolve_levers(spec, model, args, status, out: dict) -> tuple[int, int | None]:
    """--batch-size auto / --seq-len auto: the largest that fits (memfit.api.levers)."""
    batch_size, seq_len = args.batch_size, args.seq_len
    for lever in ("seq_len", "batch_size"):
        if getattr(args, lever) != "auto":
            continue
        from memfit.api.levers import largest_fitting

        status.update(f"finding the largest {lever.replace('_', ' ')} that fits...")
        found = largest_fitting(
            spec, model, lever, batch_size=batch_size if batch_size != "auto" else 1,
            seq_len=seq_len if seq_len != "auto" else None, budget=args.budget,
            device=args.gpu, optimizer=args.optimizer, task=args.task,
            on_progress=lambda m: status.update(m + "..."), **_lever_knobs(args))
        out[f"largest_{lever}"] = found.value
        if lever == "seq_len":
            seq_len = found.value
        else:
            batch_size = found.value
    return batch_size, seq_len


def _lever_knobs(args) -> dict:
    return {k: v for k, v in _knobs(args).items() if v is not None}


def _extras(spec, model, batch, args, status, p, out: dict) -> dict:
    extras = {}
    if args.export:
        export = p.export(args.export, p.batch_size)
        extras["export"] = export
        out["export"] = {"target": args.export, "config": export.config,
                         "notes": list(export.notes)}
    if args.what_if:
        from memfit.api.levers import what_if

        status.update("what if: tracing smaller sequence, hidden size and depth...")
        seq = batch["input_ids"].shape[1] if "input_ids" in batch else None
        rows = what_if(spec, batch_size=p.batch_size, seq_len=seq, device=args.gpu,
                       budget=args.budget, optimizer=args.optimizer, task=args.task,
                       precision=p.knobs.precision)
        extras["what_if"] = rows
        out["what_if"] = [r.__dict__ for r in rows]
    if args.progressive:
        from memfit.api.levers import progressive

        length, _, fraction = args.progressive.partition(":")
        status.update("sizing the progressive schedule...")
        schedule = progressive(model, batch, args.budget, short_seq_len=int(length),
                               short_fraction=float(fraction or 0.9), device=args.gpu,
                               optimizer=args.optimizer, on_progress=lambda m: status.update(m),
                               **_lever_knobs(args))
        extras["progressive"] = schedule
        out["progressive"] = schedule.to_dict()
    return extras


def _print_human(console, spec, planned, described, args, seconds: float, extras: dict) -> None:
    from memfit.report import verdict
    from memfit.units import format_bytes

    p, plain, chosen = planned.plan, planned.plain, planned.chosen
    console.print(f"[bold]{spec.name}[/bold] ({args.task or spec.default_task}), {described}, "
                  f"{args.optimizer}, precision {args.precision}, on {chosen.device.display_name}")
    where = f"a budget of {format_bytes(p.budget_bytes)}" if args.budget else \
        f"the {chosen.device.display_name} ({format_bytes(p.budget_bytes)} usable)"
    console.print("plain step:  " + verdict(plain.device_bytes, p.budget_bytes, "on " + where))
    console.print("with the plan: " + verdict(chosen.device_bytes, p.budget_bytes, "on " + where))
    console.print(p.explain(), markup=False, highlight=False)
    if p.predicted_step_time_ratio is not None:
        console.print(f"[bold]predicted slowdown: {p.predicted_step_time_ratio:.2f}x[/bold] the "
                      "plain step at the user's precision (fp32 under auto)")
    if not chosen.validated:
        console.print("[yellow]note:[/yellow] CUDA figures are a model (unvalidated until "
                      "benchmarks/gpu_check.py has run on this GPU)")
    if "export" in extras:
        export = extras["export"]
        console.print(f"\n{args.export} export:")
        console.print(json.dumps(export.config, indent=2), markup=False, highlight=False)
        for note in export.notes:
            console.print(f"  note: {note}", markup=False, highlight=False)
    if "what_if" in extras:
        from memfit.report.levers import what_if_table

        console.print(what_if_table(extras["what_if"]))
    if "progressive" in extras:
        console.print(extras["progressive"].explain(), markup=False, highlight=False)
    if args.plot:
        console.print(f"plot written to {args.plot}")
    console.print(f"planned in {seconds:.1f} s")
