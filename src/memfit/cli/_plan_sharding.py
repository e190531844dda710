"""``memfit plan --gpus N|auto [--sharding ...]`` and ``memfit plan --compare-gpus``: how many GPUs
and which plan (``memfit.api._plan_sharded``). ``cli.plan`` adds these flags and hands over when
one of them is given."""

from __future__ import annotations

import json
import sys
import time

from memfit.cli._progress import status as progress
from memfit.cli._args import add_switch, reshard_value
from memfit.knobs import SHARDINGS

__all__ = ["add_arguments", "run_if_asked"]


def _gpus(text: str):
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        import argparse
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of GPUs >= 1, or 'auto' (the "
                                         "fewest that fit)")
    return n


def add_arguments(p) -> None:
    g = p.add_argument_group("several GPUs (data parallel: FSDP2 or DDP)")
    g.add_argument("--gpus", default=None, type=_gpus, metavar="N|auto",
                   help="plan one rank of N GPUs, or 'auto': the fewest that fit; the batch is "
                        "the whole job's, split over the ranks")
    g.add_argument("--sharding", default=None, choices=SHARDINGS,
                   help="fix the layout: ddp (replicated), fsdp (FSDP2 fully_shard per "
                        "block) or none (one device); default: memfit picks")
    g.add_argument("--reshard-after-forward", default=None, type=reshard_value,
                   metavar="on|off|N",
                   help="fix FSDP2's reshard_after_forward: on, off, or reshard to N ranks "
                        "(default: memfit picks)")
    g.add_argument("--mp-policy", default=None, choices=("bf16",),
                   help="fix FSDP2's MixedPrecisionPolicy: bf16 (bf16 unsharded weights and "
                        "compute, fp32 reduce; instead of autocast). Default: where the "
                        "precision is bf16, memfit weighs it against autocast")
    add_switch(g, "--fsdp-offload",
               "fix FSDP2's CPU offload: on (sharded parameters, gradients and optimizer state "
               "in host RAM, the optimizer stepping on the host) or off. Default: for a GPU "
               "memfit weighs both")
    g.add_argument("--compare-gpus", action="store_true",
                   help="print, for every GPU in the table, the fewest cards that fit and the "
                        "predicted step time, cheapest (GPU-seconds per step) first; modelled, "
                        "not re-traced per card")


def _asked(args) -> bool:
    return args.gpus not in (None, 1) or args.sharding not in (None, "none") or \
        args.reshard_after_forward is not None or args.mp_policy is not None or \
        args.fsdp_offload is not None or args.compare_gpus


def _check(args) -> None:
    other = [f for f, v in (("--export", args.export), ("--what-if", args.what_if),
                            ("--progressive", args.progressive), ("--plot", args.plot),
                            ("--floor", args.floor), ("--hf-args", args.hf_args),
                            ("--offload-optimizer on", args.offload_optimizer is True))
             if v]
    if other:
        raise ValueError(f"{', '.join(other)} with --gpus/--sharding/--compare-gpus is not "
                         "supported yet: plan without it")
    if "auto" in (args.batch_size, args.seq_len):
        raise ValueError("--batch-size/--seq-len auto with --gpus: give the numbers")
    if args.compare_gpus and (args.gpu or args.device or args.budget or args.reserve):
        raise ValueError("--compare-gpus takes every GPU of the table at its usable memory: "
                         "leave out --gpu, --device, --budget and --reserve")


def _knobs(args, base: dict) -> dict:
    knobs = {k: v for k, v in base.items() if v is not None}
    knobs.pop("offload_optimizer", None)
    knobs.update(gpus=args.gpus or "auto", sharding=args.sharding,
                 reshard_after_forward=args.reshard_after_forward, mp_policy=args.mp_policy,
                 fsdp_offload=args.fsdp_offload)
    return {k: v for k, v in knobs.items() if v is not None}


def run_if_asked(args, base_knobs: dict) -> int | None:
    """Run the sharded plan or the comparison when their flags are given, else None."""
    if not _asked(args):
        return None
    _check(args)
    from rich.console import Console

    from memfit.cli._common import build_model, make_batch

    console = Console(stderr=args.json)
    start = time.perf_counter()
    knobs = _knobs(args, base_knobs)
    with progress(console, "building the model on the meta device...") as status:
        spec, model = build_model(args)
        batch = make_batch(spec, model, args, args.batch_size, args.seq_len)
        say = status.update
        if args.compare_gpus:
            from memfit.api._compare_gpus import compare_gpus
            knobs.pop("gpus")
            rows = compare_gpus(model, batch, args.optimizer, on_progress=say, **knobs)
        else:
            from memfit.api._plan_sharded import plan_sharded_traced
            from memfit.api.plan import plan
            from memfit.cli._common import resolve_target
            target = resolve_target(args)
            planned = plan_sharded_traced(model, batch, target.budget_bytes, args.optimizer,
                                          target.device, on_progress=say, plan_one=plan,
                                          **knobs)
    seconds = time.perf_counter() - start
    head = f"{spec.name}, batch {args.batch_size}" + \
        (f" x {args.seq_len}" if args.seq_len else "") + f", {args.optimizer}"
    if args.compare_gpus:
        return _print_rows(console, args, head, rows, seconds)
    return _print_plan(console, args, head, planned, seconds)


def _print_rows(console, args, head: str, rows, seconds: float) -> int:
    if args.json:
        json.dump({"model": head, "modelled": True, "rows": [r.to_dict() for r in rows],
                   "seconds": round(seconds, 2)}, sys.stdout, indent=2)
        print()
        return 0
    from rich import box
    from rich.table import Table

    gib = 2 ** 30
    t = Table(title=f"{head}: the fewest GPUs of each kind that fit (modelled, "
                    "cheapest GPU-seconds per step first)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col, wrap in (("GPU", False), ("n", False), ("layout", True), ("GiB per GPU", False),
                      ("step s", False), ("GPU-s", False), ("link", True)):
        t.add_column(col, no_wrap=not wrap, justify="left" if wrap or col == "GPU" else "right")
    for r in rows:
        link = r.link.split(" (")[0].replace("PCIe peer-to-peer", "PCIe p2p").replace(
            "PCIe through host memory", "PCIe via host")
        usable = f"{r.usable_bytes / gib:.1f}"
        if r.gpus is None:
            t.add_row(r.gpu, "-", r.why or "does not fit", f"- / {usable}", "-", "-", link)
            continue
        layout = r.layout.split(", ", 1)[1] if ", " in r.layout else r.layout
        layout = layout.replace(", bf16 MixedPrecisionPolicy", " MP").replace(
            ", unsharded forward to backward", " no-reshard").replace(", CPU offload",
                                                                      " offload")
        precision = "" if " MP" in layout else f" {r.precision}"     # MP computes in bf16
        t.add_row(r.gpu, str(r.gpus), f"{layout}{precision}",
                  f"{r.rank_bytes / gib:.1f} / {usable}", f"{r.step_s:.3g}",
                  f"{r.gpu_seconds:.3g}", link)
    console.print(t)
    if any("MixedPrecisionPolicy" in r.layout for r in rows):
        console.print("MP: FSDP2's MixedPrecisionPolicy (bf16 weights and compute, fp32 "
                      "reduce) instead of autocast; no-reshard: reshard_after_forward=False")
    if any("CPU offload" in r.layout for r in rows):
        console.print("offload: FSDP2's CPUOffloadPolicy (sharded weights, gradients and "
                      "optimizer state in host RAM, the optimizer stepping on the host); "
                      "`--gpus auto --gpu NAME` says how much host RAM; `--fsdp-offload off` "
                      "compares without it")
    for note in dict.fromkeys(r.note for r in rows if r.note):
        console.print(f"{', '.join(r.gpu for r in rows if r.note == note)}: {note}")
    console.print("modelled from one device's trace (memfit.api._compare_gpus); "
                  "`memfit plan --gpus auto --gpu NAME` re-traces one card's answer. "
                  f"Compared in {seconds:.1f} s")
    return 0


def _print_plan(console, args, head: str, planned, seconds: float) -> int:
    from memfit.units import format_bytes

    p, c = planned.plan, planned.candidate
    if args.json:
        json.dump({"model": head, "gpus": c.gpus, "sharding": c.sharding,
                   "reshard_after_forward": c.reshard_after_forward if c.sharding == "fsdp"
                   else None, "mp_policy": c.mp_policy, "fsdp_offload": c.offload,
                   "host_peak_bytes": planned.verified.host_peak_bytes if planned.verified
                   else None, "step_s": planned.step_s, "link": planned.link,
                   "plan": json.loads(p.to_json()), "seconds": round(seconds, 2)},
                  sys.stdout, indent=2)
        print()
        return 0
    console.print(f"[bold]{head}[/bold] on {p.device}: [bold]{c.describe()}[/bold], "
                  f"{format_bytes(p.predicted_device_bytes)} per GPU of "
                  f"{format_bytes(p.budget_bytes)}, predicted step {planned.step_s:.3g} s")
    console.print(p.explain(), markup=False, highlight=False)
    console.print(f"planned in {seconds:.1f} s")
    return 0
