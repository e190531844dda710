"""``memfit bench seed``: the seed's memory table of XLM-R base and large, for any GPU.

Rows are ``memfit estimate`` runs (``memfit.train.seed_table`` calls ``memfit.estimate`` with
exactly that command's arguments), so each number equals that command's, traced once per group
of rows that differ only in batch size and length (one trace with symbolic sizes, replayed per
shape); memfit's own plan for each model closes the table. Predicted only: there is no
measured column unless a GPU runs it (none here).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from memfit.cli._progress import status as progress
from memfit.cli._args import check_output_path

__all__ = ["add_parser", "run"]

DEFAULT_BENCH_GPU = "rtx-6000"       # the seed's workstation card (24 GB), memfit gpus' name


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write whole numbers separated by commas, "
                                         "e.g. 8,16,32") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one number, each at least 1")
    return values


def _positive(text: str) -> int:
    return _int_list(text)[0] if "," not in text else _int_list("x")


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)} "
                                             "(comma-separated)")
        return values
    return parse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmark tables (memfit bench seed)",
                       description="Benchmark tables. `memfit bench seed`: the seed's memory "
                                   "table of XLM-R base and large.")
    bsub = p.add_subparsers(dest="bench", metavar="TABLE",
                            help="the table to make: seed (the seed's XLM-R memory table)")
    s = bsub.add_parser(
        "seed", help="the seed's table: XLM-R base/large x length x fp32/fp16 x checkpointing "
                     "x batch, predicted for a GPU",
        description="The seed's memory table regenerated: XLM-RoBERTa base and large x sequence "
                    "length x fp32 / fp16 AMP x gradient checkpointing off / on x batch size, "
                    "AdamW, predicted for --gpu (each row equals `memfit estimate` with the same "
                    "flags), then memfit's own plan per model. Rows that differ only in batch "
                    "size and length share one trace (symbolic batch and length, replayed per "
                    "row; a row it cannot stand for is traced alone), about a minute cold for "
                    "the default table; results are cached in ~/.cache/memfit (keyed by "
                    "memfit's source), so a rerun is instant.")
    from memfit.train.seed_table import SEQ_LENS

    s.add_argument("--gpu", default=None, metavar="NAME",
                   help="GPU of `memfit gpus` (default: this machine's GPU when torch sees one, "
                        f"else {DEFAULT_BENCH_GPU}, the seed's Quadro RTX 6000 24 GB; the seed's "
                        "other card is gtx-1080-ti)")
    s.add_argument("--measure", action=argparse.BooleanOptionalAction, default=None,
                   help="also run every row for real on this machine's GPU and show the "
                        "measured memory beside the prediction (default: on when there is a GPU "
                        "here and --gpu is it)")
    s.add_argument("--models", type=_choices(("base", "large")), default=("base", "large"),
                   metavar="LIST", help="base, large or base,large (default: both)")
    s.add_argument("--seq-lens", type=_int_list, default=SEQ_LENS, metavar="LIST",
                   help="sequence lengths (default: 128,256,512)")
    s.add_argument("--batch-sizes", type=_int_list, default=(8, 16, 32), metavar="LIST",
                   help="batch sizes (default: 8,16,32)")
    s.add_argument("--precisions", type=_choices(("fp32", "fp16")), default=("fp32", "fp16"),
                   metavar="LIST", help="fp32, fp16 (AMP) or both (default: both)")
    s.add_argument("--checkpointing", type=_choices(("off", "on")), default=("off", "on"),
                   metavar="LIST", help="gradient checkpointing off, on or both (default: both)")
    s.add_argument("--plan-batch", type=_positive, default=32, metavar="N",
                   help="batch size of memfit's plan rows (default: 32)")
    s.add_argument("--plan-seq-len", type=int, default=None, metavar="N",
                   help="sequence length of memfit's plan rows (default: 256 if among "
                        "--seq-lens, else the longest of them)")
    s.add_argument("--no-plan", action="store_true", help="leave out memfit's plan rows")
    s.add_argument("--tiny", action="store_true",
                   help="the models' tiny twins (for tests: seconds, not minutes)")
    s.add_argument("--no-cache", action="store_true", help="trace every row again")
    s.add_argument("--jobs", type=_positive, default=None, metavar="N",
                   help="worker processes tracing rows side by side (default: one per core "
                        "this process may use)")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of the "
                   "table")
    s.add_argument("--plot", metavar="FILE.png", help="write a bar chart of the rows")
    s.set_defaults(run=run)
    p.set_defaults(run=lambda args: (p.print_help(), 2)[1] if args.bench is None else 0)
    return p


def run(args) -> int:
    check_output_path(args.plot, "--plot")
    from memfit.cli._common import resolve_device

    # a GPU named by --gpu is checked before torch is imported (refused at once)
    named = resolve_device(argparse.Namespace(gpu=args.gpu, device=None)) if args.gpu else None
    from memfit.train._seed_pool import default_jobs, trace_rows
    from memfit.train.seed_table import seed_rows

    import torch

    here = torch.cuda.is_available()
    device = named or resolve_device(argparse.Namespace(
        gpu="cuda" if here else DEFAULT_BENCH_GPU, device=None))
    if device.kind != "cuda":
        raise ValueError(f"--gpu {args.gpu}: the seed's table is for a GPU; name one of "
                         "`memfit gpus`")
    measure = _measure(args, device, here)
    models = tuple(f"xlm-roberta-{m}" for m in args.models)
    check = {"none": "none", "off": "none", "on": "all"}
    if args.plan_seq_len is None:
        args.plan_seq_len = 256 if 256 in args.seq_lens else max(args.seq_lens)
    rows = seed_rows(models, args.seq_lens, args.batch_sizes, args.precisions,
                     tuple(check[c] for c in args.checkpointing), args.tiny)
    from rich.console import Console

    console = Console(stderr=args.json)
    start = time.perf_counter()
    plan_specs = [] if args.no_plan else [(m, args.plan_seq_len, args.plan_batch, args.tiny)
                                          for m in models]
    jobs = args.jobs or default_jobs()
    with progress(console, "tracing...") as status:
        def traced(done: int, total: int) -> None:
            status.update(f"traced {done}/{total} rows and plans ({jobs} worker"
                          f"{'s' if jobs > 1 else ''})...")
        row_results, plan_results = trace_rows(rows, plan_specs, device, not args.no_cache,
                                               jobs, traced)
    if measure:
        from memfit.train.seed_measure import measure_row

        with progress(console, "measuring...") as status:
            for i, (row, r) in enumerate(zip(rows, row_results)):
                status.update(f"measuring row {i + 1}/{len(rows)} on the {device.display_name}")
                r.update(measure_row(row))
    results = list(zip(rows, row_results))
    plans = [(spec[0], r) for spec, r in zip(plan_specs, plan_results)]
    seconds = time.perf_counter() - start
    if args.plot:
        from memfit.train.seed_chart import plot_seed_table

        plot_seed_table(args.plot, results, plans, device)
    if args.json:
        out = {"gpu": device.name, "gpu_display": device.display_name,
               "usable_bytes": device.usable_bytes, "tiny": args.tiny, "measured": measure,
               "measured_note": _measured_note(measure, here),
               "rows": [{**row.__dict__, **r} for row, r in results],
               "plans": [{"model": m, "batch_size": args.plan_batch,
                          "seq_len": args.plan_seq_len, **r} for m, r in plans],
               "seconds": round(seconds, 2)}
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    _print_table(console, results, plans, device, args, seconds, measure, here)
    return 0


def _measure(args, device, here: bool) -> bool:
    """Whether to run the rows on this machine's GPU too (``--measure``), refused where the
    measured and predicted columns would be of different cards."""
    if args.measure is False or (args.measure is None and not here):
        return False
    if not here:
        import torch

        raise ValueError(f"--measure runs every row on this machine's GPU, and torch "
                         f"{torch.__version__} sees none here: drop --measure for predictions "
                         "only")
    from memfit.cli._common import resolve_device

    local = resolve_device(argparse.Namespace(gpu="cuda", device=None))
    if local.name == device.name:
        return True
    if args.measure is None:
        return False                  # predictions for another card, as asked
    raise ValueError(f"--measure runs the rows on this machine's {local.display_name}, but --gpu "
                     f"{args.gpu} predicts for the {device.display_name}: drop --gpu to compare "
                     "like with like, or drop --measure")


def _measured_note(measure: bool, here: bool) -> str:
    if not measure:
        return "predicted only" + ("" if here else " (no GPU here)")
    from memfit.train.seed_measure import allocator_note

    return "measured on this GPU, one row after another in this process, step 2 " \
        "(memfit.train.seed_measure); plan rows are predicted only" + \
        (f"; {allocator_note()}" if allocator_note() else "")


def _print_table(console, results, plans, device, args, seconds: float, measure: bool,
                 here: bool) -> None:
    from rich.table import Table

    from memfit.units import format_bytes

    t = Table(title=f"XLM-R memory per training step (AdamW) on the {device.display_name} "
                    f"({format_bytes(device.usable_bytes)} usable), predicted by memfit"
                    + (", measured on it" if measure else ""))
    numbers = ("seq", "batch", "on the device", "allocated peak", "measured on the device",
               "measured peak")
    for col in ("model", "seq", "precision", "checkpointing", "batch", "on the device",
                "allocated peak", "fits") + numbers[-2:] * measure:
        t.add_column(col, justify="right" if col in numbers else "left")
    for row, r in results:
        measured = ()
        if measure:
            measured = ("[red]out of memory[/red]", "") if r["measured_oom"] else \
                (format_bytes(r["measured_device_bytes"]),
                 format_bytes(r["measured_allocated_bytes"]))
        t.add_row(row.model.replace("xlm-roberta-", "XLM-R ") + (" (tiny)" if row.tiny else ""),
                  str(row.seq_len), "fp16 AMP" if row.precision == "fp16" else "fp32",
                  "on" if row.checkpoint == "all" else "off", str(row.batch_size),
                  format_bytes(r["device_bytes"]), format_bytes(r["peak_bytes"]),
                  "yes" if r["fits"] else "[red]no[/red]", *measured)
    for m, r in plans:
        how = f"plan: {r['precision']}, micro {r['micro_batch_size']}, {r['blocks']}" + \
              (", optimizer on host" if r["offload_optimizer"] else "")
        ratio = r["step_time_ratio"]
        t.add_row(m.replace("xlm-roberta-", "XLM-R "), str(args.plan_seq_len), how,
                  f"time {ratio:.2f}x" if ratio is not None else "", str(args.plan_batch),
                  format_bytes(r["device_bytes"]), format_bytes(r["peak_bytes"]), "yes",
                  *(("-", "-") if measure else ()))
    console.print(t)
    cached = sum(r.get("cached", False) for _, r in results + plans)
    console.print(f"{len(results)} rows and {len(plans)} plans in {seconds:.1f} s ({cached} "
                  "from the cache); 'on the device' is what `memfit estimate` reports (reserved "
                  f"+ CUDA context); {_measured_note(measure, here)}")
    if args.plot:
        console.print(f"chart written to {args.plot}")
