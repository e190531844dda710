"""``memfit estimate``: predict the memory of one training step and say whether it fits."""

from __future__ import annotations

import argparse
import json
import sys

from memfit.cli._cache_args import add_no_cache_arg
from memfit.cli._progress import status as progress
from memfit.cli._args import (add_chunked_loss_arg, add_offload_gradients_arg,
                              add_optimizer_in_backward_arg, add_switch,
                              add_zero_grad_arg, fraction, positive_float, positive_int,
                              reshard_value)
from memfit.cli._hf_args import add_hf_args_arg, check_hf_args, hf_trainer
from memfit.cli._common import (OPTIMIZER_NAMES, add_model_args, add_optimizer_impl_arg,
                                add_target_args, batch_shapes, build_model_and_batch,
                                check_model_arg, check_paths, optimizer_impl_knob,
                                packing_fields, packing_words, resolve_target)
from memfit.cli._flag_checks import check_flags
from memfit.cli._json import byte_counts_checked, spare_and_short
from memfit.cli import _report_args, _static_plan
from memfit.knobs import OPTIMIZER_STATES, PRECISIONS, SHARDINGS


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "estimate", help="predict the memory of one training step (no GPU needed)",
        description="Trace one steady-state training step (zero_grad, forward, loss, backward, "
                    "optimizer step) on fake tensors and report its peak memory, by category, "
                    "against a GPU. Default: XLM-RoBERTa-large, sequence classification, batch 8, "
                    "length 256, AdamW, fp32, on a GTX 1080 Ti.")
    add_model_args(p)
    g = p.add_argument_group("training")
    g.add_argument("--precision", default="fp32", choices=[c for c in PRECISIONS if c != "auto"],
                   help="numerics of the step (default: fp32)")
    g.add_argument("--optimizer", default="adamw", choices=OPTIMIZER_NAMES,
                   help="optimizer whose state is counted (default: adamw)")
    add_optimizer_impl_arg(g)
    add_zero_grad_arg(g)
    add_chunked_loss_arg(g)
    add_optimizer_in_backward_arg(g)
    add_hf_args_arg(g)
    g.add_argument("--compile", default=None, choices=("model", "blocks"),
                   help="estimate the step as torch.compile runs it (Inductor): 'model' compiles "
                        "the whole model, 'blocks' each repeated block as torchtitan does; what "
                        "forward saves is the partitioner's (it reads "
                        "torch._functorch.config.activation_memory_budget) and each graph's "
                        "buffers are those Inductor's code allocates")
    g.add_argument("--activation-memory-budget", type=fraction, default=None, metavar="X",
                   help="with --compile: torch.compile's activation_memory_budget, 0 to 1 (the "
                        "share of the activations forward keeps; the partitioner recomputes the "
                        "rest, 0 the most; the knob activation_memory_budget), set in "
                        "torch._functorch.config while the model compiles, where PyTorch reads "
                        "it; default: as your torch has it (1.0)")
    g = p.add_argument_group("target and output")
    add_target_args(g, budget_help="check against this many device bytes instead of the "
                                   "GPU's memory, e.g. 10GiB")
    g.add_argument("--expandable-segments", action="store_true",
                   help="model the caching allocator with expandable_segments:True "
                        "(PYTORCH_CUDA_ALLOC_CONF) instead of the default")
    g.add_argument("--micro-batch-size", type=positive_int, default=None, metavar="N",
                   help="accumulate the batch in micro-batches of N samples (default: none)")
    g.add_argument("--max-grad-norm", type=positive_float, default=None, metavar="X",
                   help="clip the global gradient norm at X (counted in the optimizer step; "
                        "default: no clipping)")
    g.add_argument("--checkpoint", default=None, metavar="POLICY",
                   help="recompute blocks in backward: all, every:K, selective (default: none)")
    g.add_argument("--offload", default=None, metavar="POLICY",
                   help="keep blocks' saved activations in host memory: all, every:K "
                        "(default: none)")
    add_switch(g, "--offload-optimizer",
               "keep the optimizer's state (and its step) in host memory: on or off (default: "
               "off)")
    add_offload_gradients_arg(g)
    g.add_argument("--offload-params", default=None, metavar="POLICY",
                   help="keep blocks' weights in host memory, fetched before each block runs: "
                        "all, every:K (needs --offload-optimizer; default: none)")
    g.add_argument("--optimizer-state", default=None, choices=OPTIMIZER_STATES, metavar="DTYPE",
                   help="store Adam/AdamW's moments in bf16, 8bit or 4bit (8bit: bitsandbytes, "
                        "bf16/4bit: torchao; changes the numerics) instead of fp32. One of "
                        f"{', '.join(OPTIMIZER_STATES)}")
    g.add_argument("--gpus", type=positive_int, default=None, metavar="N",
                   help="one rank of an N-rank data-parallel job (with --sharding; the batch is "
                        "one rank's): traced under a fake process group of N ranks")
    g.add_argument("--sharding", default=None, choices=SHARDINGS,
                   help="with --gpus: fsdp (FSDP2 fully_shard per block and at the root) or "
                        "ddp (DistributedDataParallel's gradient buckets)")
    g.add_argument("--reshard-after-forward", default=None, type=reshard_value,
                   metavar="on|off|N",
                   help="FSDP2's: free the unsharded weights after each block's forward (on, "
                        "the default), keep them to the backward (off), or reshard to N ranks")
    g.add_argument("--mp-policy", default=None, choices=("bf16",),
                   help="FSDP2's MixedPrecisionPolicy: bf16 unsharded weights and compute, fp32 "
                        "sharded weights and gradient reduction (with --precision fp32: no "
                        "autocast)")
    add_switch(g, "--fsdp-offload",
               "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state in "
               "host memory: on or off (default: off)")
    g.add_argument("--remat", action="store_true",
                   help="with --budget: simulate DTR (memfit.remat) on the traced step: its peak, "
                        "recompute FLOPs and the least budget it reaches")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_no_cache_arg(g)
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write live bytes over the step, by category, with the limit line")
    _static_plan.add_arguments(g)            # --static-plan, --static-plan-plot
    _report_args.add_arguments(g)            # --report, --snapshot, --snapshot-at
    p.set_defaults(run=run)
    return p


def _knobs(args) -> dict:
    """The knobs the flags fix (``memfit.Knobs``' fields)."""
    return dict(precision=args.precision, micro_batch_size=args.micro_batch_size,
                checkpoint=args.checkpoint, offload=args.offload,
                offload_optimizer=args.offload_optimizer, remat=args.remat or None,
                zero_grad=args.zero_grad, max_grad_norm=args.max_grad_norm,
                optimizer_state=args.optimizer_state, offload_params=args.offload_params,
                gpus=args.gpus, sharding=args.sharding,
                reshard_after_forward=args.reshard_after_forward,
                fsdp_offload=args.fsdp_offload, mp_policy=args.mp_policy,
                chunked_loss=args.chunked_loss,
                optimizer_in_backward=args.optimizer_in_backward,
                offload_gradients=args.offload_gradients,
                activation_memory_budget=args.activation_memory_budget,
                **optimizer_impl_knob(args))


def _check(args) -> None:
    """Everything that needs no trace, before the trace (and without torch: at once)."""
    from memfit.knobs import Knobs

    check_paths(args, "--plot")
    check_model_arg(args)
    check_flags(args)                    # LoRA, --quantize, --packing: the flags alone
    Knobs.from_kwargs(**_knobs(args)).check_combinations()        # policy strings etc.: ValueError naming the flag
    _report_args.check(args)
    if _static_plan.wanted(args) and (args.gpus or 1) > 1:
        raise ValueError("--static-plan needs the storages of one traced step, which an "
                         "estimate of one rank of a sharded job does not keep yet: drop "
                         "--gpus/--sharding, or --static-plan")
    if args.activation_memory_budget is not None and not args.compile:
        raise ValueError("--activation-memory-budget is torch.compile's lever: it needs "
                         "--compile model or --compile blocks")
    if args.compile and getattr(args, "quantize", None):
        raise ValueError(f"--compile with --quantize {args.quantize} is not modelled: memfit "
                         "traces a compiled step over float weights; drop --compile (or "
                         "--quantize)")
    if args.compile and getattr(args, "hf_args", None):
        raise ValueError("--compile with --hf-args: memfit traces the Trainer's eager model; "
                         "drop --compile (or estimate the model without --hf-args)")
    if args.remat and args.budget is None and not args.reserve:
        raise ValueError("--remat simulates DTR under a budget: give --budget (e.g. 80% of the "
                         "step's peak)")


def run(args) -> int:
    _check(args)                  # before the imports: bad input is refused at once
    hf = check_hf_args(args, precision_default="fp32")
    target = resolve_target(args)
    from rich.console import Console

    from memfit.api.estimate import estimate
    from memfit.trace.allocator import AllocatorConfig

    console = Console(stderr=args.json)
    with progress(console, "building the model on the meta device and tracing one step..."):
        if hf is not None:             # the Trainer run of --hf-args, on the meta device
            spec, model, est, batch = _trainer_estimate(args, hf, target)
        else:
            spec, model, batch = build_model_and_batch(args)
            if args.compile:
                from memfit.trace.compiled import compile_model

                model = compile_model(model, args.compile)
            allocator = AllocatorConfig(expandable_segments=args.expandable_segments)
            with _report_args.recording(args, model) as record:
                est = estimate(model, batch, optimizer=args.optimizer, device=target.device,
                               budget=target.budget_bytes, allocator=allocator, **_knobs(args))
    shapes = batch_shapes(batch)
    described = describe_batch(batch) + packing_words(args, model, batch)
    tracker = record.tracker if hf is None and record is not None else None
    if args.plot:
        from memfit.report import plot_timeline

        plot_timeline(args.plot, est, limit_bytes=est.limit_bytes,
                      limit_label="budget" if args.budget else f"{est.device.display_name} usable",
                      title=f"{spec.name}, {described}, {est.knobs.precision}, {args.optimizer}",
                      record=tracker)
    written = [] if hf is not None else _report_args.write_estimate(
        args, est, tracker, title=f"{spec.name}, {described}, {est.knobs.precision}, "
                                 f"{args.optimizer}", where=target.where(), allocator=allocator)
    if args.json:
        from memfit.cli._adapt import adaptation

        out = {"model": spec.name, "task": args.task or spec.default_task, "batch": shapes,
               "optimizer": args.optimizer, "reserve_bytes": target.reserve_bytes,
               **({"hf_args": args.hf_args} if args.hf_args else {}),
               **({"chunked_loss": est.knobs.chunked_loss} if est.knobs.chunked_loss else {}),
               **({"optimizer_in_backward": True} if est.knobs.optimizer_in_backward else {}),
               **({"offload_gradients": True} if est.knobs.offload_gradients else {}),
               **packing_fields(args, model, batch),
               **adaptation(args),
               "trainable_parameters": _trainable(model), **spare_and_short(est.to_dict())}
        if args.plot:
            out["plot"] = args.plot
        _static_plan.run(args, est, out)
        out.update({k: getattr(args, k) for k in ("report", "snapshot") if getattr(args, k)})
        json.dump(byte_counts_checked(out), sys.stdout, indent=2)
        print()
        return 0
    _print_human(console, spec, model, est, described, args, target)
    _static_plan.run(args, est, console)
    for line in written:
        console.print(line, markup=False, highlight=False)
    return 0


def card_line(card) -> str:
    """The card breakdown in one line: each non-zero line, then the driver's share (trace.card)."""
    from memfit.units import format_bytes

    names = {"allocator": "tensors and cache", "cublas_workspace": "cuBLAS workspace",
             "cuda_context": "CUDA context", "library_kernels": "kernels loaded",
             "cudnn": "cuDNN", "nccl": "NCCL", "unified_memory": "paged optimizer state"}
    parts = " + ".join(f"{names[k]} {format_bytes(v)}" for k, v in card.lines.items() if v)
    return (f"on the card: {parts} = {format_bytes(card.device_bytes)}; with the driver's "
            f"{format_bytes(card.driver_reserved_bytes)}, nvidia-smi would show "
            f"{format_bytes(card.card_used_bytes)} of {format_bytes(card.card_total_bytes)}")


def _trainer_estimate(args, values: dict, target):
    """The estimate of the --hf-args Trainer run, and one micro-batch of it (for the output)."""
    from memfit.cli._common import build_model, make_batch
    from memfit.integrations import transformers as mf_hf

    spec, model = build_model(args)
    trainer = hf_trainer(spec, model, args, values)
    optim = trainer.args.optim                  # the run's optimizer is the file's (--optimizer
    args.optimizer = getattr(optim, "value", optim)    # is refused with --hf-args): said so
    est = mf_hf.estimate(trainer, device=target.device, budget=target.budget_bytes)
    batch = make_batch(spec, model, args, trainer.args.per_device_train_batch_size, args.seq_len)
    return spec, model, est, batch


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def trainable_line(model, args) -> str:
    """"trains 1.2M of 125M parameters (LoRA rank 8; frozen: ...)" for --lora-rank/--freeze."""
    from memfit.cli._adapt import adaptation, parameter_count

    total = parameter_count(model)
    done = adaptation(args)                    # what --json says, in words
    how = [f"LoRA rank {done['lora_rank']}"] if "lora_rank" in done else []
    if "quantize" in done:                     # the base as held (not a knob: the model's own)
        how.append(f"{done['quantize']} base" +
                   (" with double quantization" if done.get("double_quant") else ""))
    how += [f"frozen: {' '.join(done['freeze'])}"] if "freeze" in done else []
    return (f"trains {_trainable(model) / 1e6:.3g}M of {total / 1e6:.4g}M parameters "
            f"({'; '.join(how)})")


def describe_batch(batch) -> str:
    """"batch 8 x 256" from the main input (input_ids or pixel_values)."""
    for key in ("input_ids", "pixel_values", "inputs_embeds"):
        if key in batch:
            return "batch " + " x ".join(str(d) for d in batch[key].shape)
    return "batch " + ", ".join(f"{k} {tuple(v)}" for k, v in batch_shapes(batch).items())


def _print_human(console, spec, model, est, described, args, target) -> None:
    from memfit.report import breakdown_table, verdict
    from memfit.units import format_bytes

    if args.hf_args:
        console.print(f"[bold]{spec.name}[/bold] ({args.task or spec.default_task}), the Trainer "
                      f"run of {args.hf_args}: {described} per micro-batch, "
                      f"{est.knobs.precision}, {args.optimizer}")
    else:
        console.print(f"[bold]{spec.name}[/bold] ({args.task or spec.default_task}), {described}, "
                      f"{est.knobs.precision}, {args.optimizer}")
    if args.freeze or args.lora_rank:
        console.print(trainable_line(model, args))
    if args.zero_grad:
        console.print(f"loop style: zero_grad {args.zero_grad}")
    if est.knobs.chunked_loss:
        console.print(f"loss: chunked over {est.knobs.chunked_loss} pieces of the tokens, each "
                      "piece's logits recomputed in backward")
    if est.knobs.optimizer_in_backward:
        console.print("optimizer: stepped in backward, one parameter at a time, each gradient "
                      "freed as soon as it is stepped")
    if est.knobs.offload_gradients:
        console.print("gradients: each copied to the host as backward makes it, and freed on "
                      "the device")
    title = "Memory at the peak of one steady-state step"
    if est.basis == "cuda-model":
        title += f" (CUDA model, {est.device.display_name})"
    console.print(breakdown_table(est.breakdown, est.peak_bytes, title=title))
    if est.basis == "cuda-model":
        console.print(f"allocated peak {format_bytes(est.peak_bytes)}, reserved by the caching "
                      f"allocator {format_bytes(est.reserved_bytes)}, + outside it "
                      f"{format_bytes(est.context_bytes)} = {format_bytes(est.device_bytes)} on "
                      "the device" + ("" if est.device.profile_path else
                                      " [yellow](unvalidated)[/yellow]"))
        if est.card is not None:
            console.print(card_line(est.card))
    console.print(verdict(est.device_bytes, est.limit_bytes, "on " + target.where()))
    if est.host_peak_bytes and (args.offload not in (None, "none") or args.offload_optimizer
                                or args.fsdp_offload):
        console.print(f"host RAM for offload: {format_bytes(est.host_peak_bytes)} at its peak")
    if est.remat_peak_bytes is not None:
        console.print(f"DTR (simulated): peak {format_bytes(est.remat_peak_bytes)}, recompute "
                      f"{est.remat_recompute_flops / 1e12:.3f} TFLOP, least budget it reaches "
                      f"{format_bytes(est.remat_floor_bytes)}")
    console.print(f"forward {est.fw_flops / 1e12:.2f} TFLOP, backward {est.bw_flops / 1e12:.2f} "
                  f"TFLOP; traced in {est.trace_seconds:.2f} s"
                  + (f" ({est.traced_as})" if est.traced_as != "whole" else ""))
    for note in est.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if args.plot:
        console.print(f"plot written to {args.plot}")
