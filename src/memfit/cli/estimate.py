"""``memfit estimate``: predict the memory of one training step and say whether it fits."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from memfit.cli._common import DEFAULT_GPU, add_model_args, build_model_and_batch
from memfit.knobs import PRECISIONS
from memfit.optimizers import OPTIMIZERS


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
    g.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZERS),
                   help="optimizer whose state is counted (default: adamw)")
    g = p.add_argument_group("target and output")
    g.add_argument("--gpu", default=DEFAULT_GPU, metavar="NAME",
                   help=f"GPU to check against, or 'cpu' (default: {DEFAULT_GPU})")
    g.add_argument("--budget", default=None, metavar="BYTES",
                   help="check against this many bytes instead of the GPU's memory, e.g. 10GiB")
    g.add_argument("--expandable-segments", action="store_true",
                   help="model the caching allocator with expandable_segments:True "
                        "(PYTORCH_CUDA_ALLOC_CONF) instead of the default")
    g.add_argument("--micro-batch-size", type=int, default=None, metavar="N",
                   help="accumulate the batch in micro-batches of N samples (default: none)")
    g.add_argument("--checkpoint", default=None, metavar="POLICY",
                   help="recompute blocks in backward: all, every:K, selective (default: none)")
    g.add_argument("--offload", default=None, metavar="POLICY",
                   help="keep blocks' saved activations in host memory: all, every:K "
                        "(default: none)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="keep the optimizer's state (and its step) in host memory")
    g.add_argument("--remat", action="store_true",
                   help="with --budget: simulate DTR (memfit.remat) on the traced step: its peak, "
                        "recompute FLOPs and the least budget it reaches")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    g.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write live bytes over the step, by category, with the limit line")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    import memfit

    console = Console(stderr=args.json)
    with console.status("building the model on the meta device and tracing one step..."):
        spec, model, batch = build_model_and_batch(args)
        from memfit.trace.allocator import AllocatorConfig

        est = memfit.estimate(model, batch, optimizer=args.optimizer, device=args.gpu,
                              budget=args.budget, precision=args.precision,
                              micro_batch_size=args.micro_batch_size,
                              checkpoint=args.checkpoint, offload=args.offload,
                              offload_optimizer=args.offload_optimizer or None,
                              remat=args.remat or None,
                              allocator=AllocatorConfig(expandable_segments=args.expandable_segments))
    shapes = {k: list(v.shape) for k, v in batch.items()}
    described = describe_batch(batch)
    if args.plot:
        from memfit.report import plot_timeline

        plot_timeline(args.plot, est.timeline_by_category, phases=est.phases,
                      limit_bytes=est.limit_bytes,
                      limit_label="budget" if args.budget else f"{est.device.display_name} usable",
                      title=f"{spec.name}, {described}, {args.precision}, {args.optimizer}")
    if args.json:
        out = {"model": spec.name, "task": args.task or spec.default_task, "batch": shapes,
               "optimizer": args.optimizer, **est.to_dict()}
        if args.plot:
            out["plot"] = args.plot
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    _print_human(console, spec, est, described, args)
    return 0


def describe_batch(batch) -> str:
    """"batch 8 x 256" from the main input (input_ids or pixel_values)."""
    for key in ("input_ids", "pixel_values", "inputs_embeds"):
        if key in batch:
            return "batch " + " x ".join(str(d) for d in batch[key].shape)
    return "batch " + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items())


def _print_human(console, spec, est, described, args) -> None:
    from memfit.report import breakdown_table, verdict
    from memfit.units import format_bytes

    console.print(f"[bold]{spec.name}[/bold] ({args.task or spec.default_task}), {described}, "
                  f"{args.precision}, {args.optimizer}")
    title = "Memory at the peak of one steady-state step"
    if est.basis == "cuda-model":
        title += f" (CUDA model, {est.device.display_name})"
    console.print(breakdown_table(est.breakdown, est.peak_bytes, title=title))
    if est.basis == "cuda-model":
        console.print(f"allocated peak {format_bytes(est.peak_bytes)}, reserved by the caching "
                      f"allocator {format_bytes(est.reserved_bytes)}, + CUDA context "
                      f"{format_bytes(est.context_bytes)} = {format_bytes(est.device_bytes)} on "
                      "the device [yellow](unvalidated)[/yellow]")
    where = f"on a budget of {format_bytes(est.limit_bytes)}" if args.budget else \
        f"on the {est.device.display_name} ({format_bytes(est.device.usable_bytes)} usable)"
    console.print(verdict(est.device_bytes, est.limit_bytes, where))
    if est.host_peak_bytes:
        console.print(f"host memory (offload): {format_bytes(est.host_peak_bytes)} at its peak")
    if est.remat_peak_bytes is not None:
        console.print(f"DTR (simulated): peak {format_bytes(est.remat_peak_bytes)}, recompute "
                      f"{est.remat_recompute_flops / 1e12:.3f} TFLOP, least budget it reaches "
                      f"{format_bytes(est.remat_floor_bytes)}")
    console.print(f"forward {est.fw_flops / 1e12:.2f} TFLOP, backward {est.bw_flops / 1e12:.2f} "
                  f"TFLOP; traced in {est.trace_seconds:.2f} s")
    for note in est.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if args.plot:
        console.print(f"plot written to {args.plot}")
