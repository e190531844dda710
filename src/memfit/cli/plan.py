"""``memfit plan``: the fastest way to make a training step fit a GPU, and what it costs."""

from __future__ import annotations

import argparse
import json
import sys
import time

from memfit.cli._cache_args import add_no_cache_arg
from memfit.cli._progress import status as progress
from memfit.cli._args import (add_chunked_loss_arg, add_offload_gradients_arg,
                              add_optimizer_in_backward_arg, add_switch,
                              add_zero_grad_arg, positive_float, positive_int, progressive_spec)
from memfit.cli._common import (OPTIMIZER_NAMES, adapted, add_model_args, add_optimizer_impl_arg,
                                add_target_args, batch_shapes, build_model, check_model_arg,
                                check_paths, make_batch, optimizer_impl_knob, packing_fields,
                                packing_words, resolve_target)
from memfit.cli._flag_checks import check_flags
from memfit.cli import _plan_sharding
from memfit.cli._hf_args import add_hf_args_arg, check_hf_args, export_path, hf_trainer
from memfit.cli._json import byte_counts_checked
from memfit.cli.estimate import describe_batch, trainable_line
from memfit.knobs import OPTIMIZER_STATES, PRECISIONS

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
                   help="numerics of the step (default: auto: the GPU's 16-bit autocast; the "
                        "plain step it is compared with is fp32)")
    g.add_argument("--optimizer", default="adamw", choices=OPTIMIZER_NAMES,
                   help="optimizer whose state is counted (default: adamw)")
    add_optimizer_impl_arg(g)
    add_zero_grad_arg(g)
    add_chunked_loss_arg(g, plan=True)
    add_optimizer_in_backward_arg(g, plan=True)
    g.add_argument("--micro-batch-size", type=positive_int, default=None, metavar="N",
                   help="fix the micro-batch size (default: memfit picks)")
    g.add_argument("--checkpoint", default=None, metavar="POLICY",
                   help="fix recompute: none, all, every:K, selective (default: memfit picks "
                        "per block)")
    g.add_argument("--offload", default=None, metavar="POLICY",
                   help="fix activation offload: none, all, every:K (default: memfit picks)")
    add_switch(g, "--offload-optimizer",
               "fix where the optimizer state lives: on (host memory) or off (the device); "
               "default: memfit picks")
    add_offload_gradients_arg(g, plan=True)
    g.add_argument("--offload-params", default=None, metavar="POLICY",
                   help="fix which blocks' weights live in host memory, fetched before each "
                        "block runs: none, all, every:K (needs the optimizer state on the host; "
                        "default: memfit picks, as a last resort)")
    g.add_argument("--optimizer-state", default=None, choices=OPTIMIZER_STATES, metavar="DTYPE",
                   help="fix how Adam/AdamW's moments are stored: fp32, bf16, 8bit or 4bit "
                        "(8bit: bitsandbytes, bf16/4bit: torchao; changes the numerics); default: memfit "
                        "may pick a low-bit one under precision auto")
    g.add_argument("--max-grad-norm", type=positive_float, default=None, metavar="X",
                   help="clip the global gradient norm at X (counted in the optimizer step)")
    g.add_argument("--no-numerics-change", action="store_true",
                   help="never weigh levers that change the numerics (low-bit "
                        "8-bit/4-bit/bf16 optimizer states; a LoRA job's frozen base in NF4, "
                        "QLoRA), which precision auto allows")
    g = p.add_argument_group("target and output")
    add_target_args(g, budget_help="device bytes to fit, e.g. 10GiB (default: the GPU's usable "
                                   "memory)")
    g.add_argument("--export", default=None, choices=EXPORTS,
                   help="also print the plan as Hugging Face TrainingArguments keywords, an "
                        "Accelerate config or a DeepSpeed config")
    g.add_argument("--what-if", action="store_true",
                   help="also print peak memory as sequence length, hidden size and layer "
                        "count shrink (the plain step at the plan's precision)")
    g.add_argument("--progressive", default=None, type=progressive_spec,
                   metavar="LEN[:FRACTION]",
                   help="also size a progressive schedule: FRACTION of the steps (default 0.9) "
                        "at length LEN (below the full length), the rest at full length, each "
                        "phase planned to fit")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_no_cache_arg(g)
    add_hf_args_arg(g)
    g.add_argument("--floor", action="store_true",
                   help="also trace the floor, the least any configuration needs, when a plan "
                        "fits (minutes on a large model; traced anyway when nothing fits)")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write device bytes over the step before (plain) and after (planned), "
                        "with the budget line")
    from memfit.cli import _report_args        # --report, --snapshot (report.html, .snapshot)
    _report_args.add_arguments(g)
    _plan_sharding.add_arguments(p)
    p.set_defaults(run=run)
    return p


def _knobs(args) -> dict:
    return dict(precision=args.precision, micro_batch_size=args.micro_batch_size,
                checkpoint=args.checkpoint, offload=args.offload,
                offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
                optimizer_state=args.optimizer_state, max_grad_norm=args.max_grad_norm,
                zero_grad=args.zero_grad, chunked_loss=args.chunked_loss,
                optimizer_in_backward=args.optimizer_in_backward,
                offload_gradients=args.offload_gradients, **optimizer_impl_knob(args))


def _check(args) -> None:
    """Everything that needs no trace, before the trace: paths, knob values, the GPU."""
    from memfit.knobs import Knobs

    check_paths(args, "--plot")
    check_model_arg(args)                      # without torch: refused in under a second
    check_flags(args)
    from memfit.cli import _report_args

    _report_args.check(args)                   # --report, --snapshot: as --plot, before a trace
    Knobs.from_kwargs(**_knobs(args)).check_combinations()          # policy strings etc.: ValueError naming the flag
    if args.progressive and args.seq_len != "auto" and args.seq_len is not None and \
            args.progressive[0] >= args.seq_len:
        raise ValueError(f"--progressive {args.progressive[0]}: the short length must be below "
                         f"--seq-len {args.seq_len}")


def run(args) -> int:
    _check(args)                  # before the imports: bad input is refused at once
    if (code := _plan_sharding.run_if_asked(args, _knobs(args))) is not None:
        return code
    hf = check_hf_args(args, precision_default="auto")
    target = resolve_target(args)
    if hf is not None:
        return _run_trainer(args, hf, target)
    from rich.console import Console

    from memfit.api.plan import plan_traced

    console = Console(stderr=args.json)
    start = time.perf_counter()
    out: dict = {}
    with progress(console, "building the model on the meta device...") as status:
        spec, model = build_model(args)
        _check_progressive_limit(spec, model, args)
        batch_size, seq_len, planned = _resolve_levers(spec, model, args, target, status, out)
        batch = make_batch(spec, model, args, batch_size, seq_len)
        _check_progressive(batch, args)
        if planned is None or args.floor:       # else the lever search's plan at its answer
            planned = plan_traced(model, batch, target.api_budget, args.optimizer,
                                  target.device, on_progress=status.update,
                                  floor=args.floor, allow_numerics_change=_numerics(args),
                                  **_knobs(args))
        extras = _extras(spec, model, batch, args, target, status, planned.plan, out)
    p, seconds = planned.plan, time.perf_counter() - start
    described = describe_batch(batch) + packing_words(args, model, batch)
    from memfit.cli import _report_args        # --report, --snapshot: plain beside planned
    if args.plot:
        from memfit.report import plot_before_after

        # on a GPU target the curve is the allocator's (plots): both steps re-traced
        records = (_report_args.plan_records(args, model, batch, planned,
                                             optimizer=args.optimizer, device=target.device)
                   if planned.plain.basis == "cuda-model" else (None, None))
        plot_before_after(args.plot, planned.plain, planned.chosen, limit_bytes=p.budget_bytes,
                          titles=(f"plain step ({planned.plain.knobs.precision})",
                                  f"with the plan ({p.knobs.precision})"),
                          suptitle=f"{spec.name}, {described}, {args.optimizer}, {p.device}",
                          records=records)
    for line in _report_args.write_plan(args, model, batch, planned, optimizer=args.optimizer,
                                        device=target.device, where=target.where(),
                                        title=f"{spec.name}, {described}, {args.optimizer}"):
        console.print(line, markup=False, highlight=False)
    if args.json:
        from memfit.cli._adapt import adaptation

        out.update({"model": spec.name, "task": args.task or spec.default_task,
                    "batch": batch_shapes(batch),
                    **packing_fields(args, model, batch),
                    "optimizer": args.optimizer, "reserve_bytes": target.reserve_bytes,
                    **adaptation(args),
                    "trainable_parameters": sum(t.numel() for t in model.parameters()
                                                if t.requires_grad),
                    "plain_precision": planned.plain.knobs.precision,
                    "plain_device_bytes": planned.plain.device_bytes,
                    "host_peak_bytes": _host_bytes(planned.chosen),
                    "plan": json.loads(p.to_json()), "validated": planned.chosen.validated,
                    "allocator": None if p.allocator is None else dict(p.allocator),
                    "seconds": round(seconds, 2)})
        if args.plot:
            out["plot"] = args.plot
        json.dump(byte_counts_checked(out), sys.stdout, indent=2)
        print()
        return 0
    _print_human(console, spec, model, planned, described, args, target, seconds, extras)
    return 0


def _host_bytes(est) -> int:
    """Host memory the step's offload needs (0 when nothing is offloaded)."""
    k = est.knobs
    offloads = k.offload_optimizer or k.offload not in (None, "none")
    return est.host_peak_bytes if offloads else 0


def _run_trainer(args, values: dict, target) -> int:
    """``plan --hf-args F``: fit the Trainer run of F under the budget (cli._hf_args)."""
    for flag, value in (("--what-if", args.what_if), ("--progressive", args.progressive),
                        ("--plot", args.plot), ("--floor", args.floor)):
        if value:
            raise ValueError(f"{flag} is for memfit's own step, not with --hf-args")
    if args.export not in (None, "transformers"):
        raise ValueError(f"--export {args.export} with --hf-args: the export of a Trainer run "
                         "is its TrainingArguments: --export transformers")
    from rich.console import Console

    from memfit.integrations import transformers as mf_hf

    console = Console(stderr=args.json)
    with progress(console, "building the model on the meta device and planning the Trainer run..."):
        spec, model = build_model(args)
        trainer = hf_trainer(spec, model, args, values)
        changes = mf_hf.fit(trainer, target.budget_bytes, device=target.device, verbose=False)
    out = {"model": spec.name, "hf_args": args.hf_args, "budget_bytes": changes.budget_bytes,
           "plain_device_bytes": changes.plain_device_bytes,
           "predicted_peak_bytes": changes.predicted_peak_bytes,
           "predicted_device_bytes": changes.predicted_device_bytes,
           "predicted_step_time_ratio": changes.predicted_step_time_ratio,
           "args": {k: after for k, (before, after) in changes.args.items()},
           "blocks": changes.blocks, "optimizer_offloaded": changes.optimizer_offloaded}
    not_args = [what for what, on in (
        ("per-block hooks", any(m != "keep" for m in changes.blocks.values())),
        ("memfit's optimizer offload", changes.optimizer_offloaded)) if on]
    if args.export:
        path = export_path(args.hf_args)
        path.write_text(json.dumps({**values, **out["args"]}, indent=2) + "\n")
        out["export"] = {"path": str(path), "not_in_arguments": not_args}
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    console.print(str(changes))
    if args.export:
        console.print(f"changed TrainingArguments written to {out['export']['path']}")
        if not_args:
            console.print(f"not TrainingArguments keywords ({', '.join(not_args)}): "
                          "memfit.integrations.transformers.fit(trainer, budget) applies them")
    return 0


def _check_progressive_limit(spec, model, args) -> None:
    """--progressive LEN against the model's position limit, before any trace: the full length
    must be longer than LEN, so LEN must be below the limit."""
    if not args.progressive:
        return
    from memfit.cli._adapt import base_model
    from memfit.zoo._batches import position_limit

    length = args.progressive[0]
    config = getattr(base_model(model), "config", None)
    limit, why = position_limit(config) if config is not None else (None, "")
    if limit is not None and length >= limit:
        raise ValueError(f"--progressive {length}: the short length must be below the full "
                         f"length, and {spec.name} takes at most {limit} tokens ({why}): use "
                         f"--progressive {min(limit // 2, 128)} or another length below {limit}")


def _check_progressive(batch, args) -> None:
    if not args.progressive:
        return
    if "input_ids" not in batch:
        raise ValueError("--progressive shortens sequences: it needs a text model (this batch "
                         f"has {', '.join(batch)})")
    full = batch["input_ids"].shape[1]
    if args.progressive[0] >= full:
        raise ValueError(f"--progressive {args.progressive[0]}: the short length must be below "
                         f"the full length {full} (--seq-len)")


def _numerics(args) -> bool | None:
    return False if args.no_numerics_change else None


def _resolve_levers(spec, model, args, target, status, out: dict):
    """--batch-size auto / --seq-len auto: the largest at which plan fits (memfit.api.levers);
    ``(batch size, sequence length, the plan at them or None)``."""
    batch_size, seq_len, planned = args.batch_size, args.seq_len, None
    if seq_len == "auto" and spec.family == "vision":
        raise ValueError(f"--seq-len auto: {spec.name} takes images, which have no sequence "
                         "length to search; give --batch-size auto for the largest batch that "
                         "fits, or --image-size N for another image size")
    for lever in ("seq_len", "batch_size"):
        if getattr(args, lever) != "auto":
            continue
        from memfit.api.levers import largest_fitting

        status.update(f"finding the largest {lever.replace('_', ' ')} that fits...")
        found = largest_fitting(
            spec, model, lever, batch_size=batch_size if batch_size != "auto" else 1,
            seq_len=seq_len if seq_len != "auto" else None, budget=target.api_budget,
            device=target.device, optimizer=args.optimizer, task=args.task,
            on_progress=status.update,
            allow_numerics_change=_numerics(args), **_lever_knobs(args))
        out[f"largest_{lever}"] = found.value
        # the seq_len search's plan is plan's own at the answer (the batch lever's fixes one
        # micro-batch: levers), so it is the plan printed
        same_batch = args.batch_size != "auto" and not args.padded and args.image_size is None
        planned = found.planned if lever == "seq_len" and same_batch else None
        if lever == "seq_len":
            seq_len = found.value
        else:
            batch_size = found.value
    return batch_size, seq_len, planned


def _lever_knobs(args) -> dict:
    return {k: v for k, v in _knobs(args).items() if v is not None}


def _extras(spec, model, batch, args, target, status, p, out: dict) -> dict:
    extras = {}
    if args.export:
        export = p.export(args.export, p.batch_size)
        extras["export"] = export
        out["export"] = {"target": args.export, "config": export.config,
                         "notes": list(export.notes)}
    if args.what_if:
        from memfit.studies import what_if

        status.update("what if: tracing smaller sequence, hidden size and depth...")
        seq = batch["input_ids"].shape[1] if "input_ids" in batch else None
        rows = what_if(spec, batch_size=p.batch_size, seq_len=seq, device=target.device,
                       budget=target.budget_bytes, optimizer=args.optimizer, task=args.task,
                       precision=p.knobs.precision, on_progress=status.update,
                       adapt=lambda m: adapted(spec, m, args),          # the plan's model
                       batch_for=lambda m, L: make_batch(spec, m, args, p.batch_size, L))
        extras["what_if"] = rows
        out["what_if"] = [r.__dict__ for r in rows]
    if args.progressive:
        from memfit.studies import progressive

        length, fraction = args.progressive
        status.update("sizing the progressive schedule...")
        schedule = progressive(model, batch, target.budget_bytes, short_seq_len=length,
                               short_fraction=fraction, device=target.device,
                               optimizer=args.optimizer, on_progress=status.update,
                               **_lever_knobs(args))
        extras["progressive"] = schedule
        out["progressive"] = schedule.to_dict()
    return extras


def _print_human(console, spec, model, planned, described, args, target, seconds: float,
                 extras: dict) -> None:
    from memfit.report import verdict
    from memfit.units import format_bytes

    p, plain, chosen = planned.plan, planned.plain, planned.chosen
    console.print(f"[bold]{spec.name}[/bold] ({args.task or spec.default_task}), {described}, "
                  f"{args.optimizer}, precision {args.precision}, on {chosen.device.display_name}")
    if args.freeze or args.lora_rank:
        console.print(trainable_line(model, args))
    where = "on " + target.where()
    console.print(f"plain step ({plain.knobs.precision}, the whole batch at once): "
                  + verdict(plain.device_bytes, p.budget_bytes, where))
    console.print(f"with the plan ({p.knobs.precision}): "       # the plan's own bytes
                  + verdict(p.predicted_device_bytes, p.budget_bytes, where))
    if p.allocator:
        from memfit.api._plan_allocator import setting_name
        console.print(f"allocator setting: {setting_name(p.allocator)} "
                      f"({format_bytes(p.allocator['saved_bytes'])} less reserved than the "
                      "default, modelled)")
    host = _host_bytes(chosen)
    if host:
        console.print(f"host RAM for offload: {format_bytes(host)} at its peak (beside the "
                      "training process's own)")
    from memfit.cli._errors import to_flags

    explanation = to_flags(p.explain(), bare=False)     # the API's name=value as flags
    console.print(explanation, markup=False, highlight=False)
    if p.predicted_step_time_ratio is not None and "step time" not in explanation:
        console.print(f"[bold]predicted step time: {p.predicted_step_time_ratio:.2f}x[/bold] the "
                      f"plain step ({plain.knobs.precision})")
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
