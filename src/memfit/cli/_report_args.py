"""``--report FILE.html`` and ``--snapshot FILE.pickle``: the flags and their writers, shared by
``memfit estimate`` and ``memfit plan`` (``memfit.report.html``, ``memfit.report.snapshot``).

Nothing here imports torch at import time (``memfit --help`` stays fast).
"""

from __future__ import annotations

import contextlib

from memfit.cli._args import check_output_file

__all__ = ["add_arguments", "check", "recording", "write_estimate", "write_plan"]


def add_arguments(g) -> None:
    """The flags, in parser or group ``g``."""
    g.add_argument("--report", default=None, metavar="FILE.html", type=_html_path,
                   help="write an interactive report: one self-contained HTML file (no network "
                        "needed) with the step's memory over time by category, the budget and "
                        "the card's limit, the per-block table and the verdict's numbers")
    g.add_argument("--snapshot", default=None, metavar="FILE.pickle", type=_pickle_path,
                   help="write the traced step as a PyTorch memory snapshot (the format of "
                        "torch.cuda.memory._dump_snapshot), for torch.cuda._memory_viz or "
                        "https://pytorch.org/memory_viz")
    g.add_argument("--snapshot-at", default="end", choices=("end", "peak"),
                   help="with --snapshot: take it after the step's last op (end, the default) "
                        "or right after the op at the allocated peak (peak)")


def _html_path(text: str) -> str:
    return _checked(text, (".html", ".htm"))


def _pickle_path(text: str) -> str:
    return _checked(text, (".pickle", ".pkl"))


def _checked(text: str, suffixes: tuple[str, ...]) -> str:
    """The path, if it can be written (checked as the flags are read, before any trace)."""
    import argparse

    try:
        check_output_file(text, "", suffixes)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def check(args) -> None:
    """Before any trace: the flags go together (the paths were checked as they were read),
    and plotly is there for --report."""
    import importlib.util

    if args.report and importlib.util.find_spec("plotly") is None:
        raise ValueError("--report draws with plotly, which is not installed: "
                         "pip install 'memfit[report]' (or pip install plotly)")
    if args.snapshot_at != "end" and not args.snapshot:
        raise ValueError("--snapshot-at needs --snapshot FILE.pickle")
    if args.snapshot and getattr(args, "expandable_segments", False):
        raise ValueError("--snapshot with --expandable-segments is not written yet: leave one "
                         "of them out")
    if (args.report or args.snapshot) and (getattr(args, "gpus", None) or
                                           getattr(args, "hf_args", None)):
        raise ValueError("--report and --snapshot draw memfit's own single-GPU step: leave "
                         "them out with --gpus or --hf-args")


def wanted(args) -> bool:
    """An output needs the trace's record (the PNG plot too: its allocated curve)."""
    return bool(args.report or args.snapshot or getattr(args, "plot", None))


@contextlib.contextmanager
def recording(args, model):
    """Around ``memfit.estimate(model, ...)``: keeps the trace's record when an output needs
    it (``memfit.report._capture``); yields the capture, or None."""
    if not wanted(args) or getattr(args, "gpus", None):     # one rank's trace: not drawn
        yield None
        return
    from memfit.report._capture import traced

    with traced(model) as cap:
        yield cap


def write_estimate(args, est, tracker, *, title: str, where: str,
                   allocator=None) -> list[str]:
    """Write what was asked for one estimated step (``tracker``: its trace's record, from
    ``recording``); returns lines to print."""
    out = []
    if args.report:
        from memfit.report.html import step_view, write_report

        view = step_view(est, tracker, label="the estimated step", allocator=allocator)
        write_report(args.report, [view], title=title, where=where,
                     budget_bytes=est.limit_bytes if args.budget is not None else None)
        out.append(f"report written to {args.report}")
    if args.snapshot:
        from memfit.report.snapshot import write_snapshot

        write_snapshot(args.snapshot, est, tracker, at=args.snapshot_at, allocator=allocator)
        out.append(f"snapshot written to {args.snapshot} (open it with "
                   "python -m torch.cuda._memory_viz trace_plot, or pytorch.org/memory_viz)")
    return out


def write_plan(args, model, batch, planned, *, optimizer: str, device, title: str,
               where: str, allocator=None, loss_fn=None) -> list[str]:
    """Write what was asked for a plan: the plain step beside the planned one, each re-traced
    with the record kept (the figures must be the plan's own, else the record is not used)."""
    if not (args.report or args.snapshot):
        return []
    check(args)
    steps = []
    chosen, predicted = planned.chosen, planned.plan.predicted_peak_bytes
    held = max(0, predicted - chosen.peak_bytes) if predicted is not None else 0
    records = plan_records(args, model, batch, planned, optimizer=optimizer, device=device,
                           allocator=allocator, loss_fn=loss_fn)
    for est, tracker, label, extra in ((planned.plain, records[0], "plain step", 0),
                                       (chosen, records[1], "with the plan", held)):
        steps.append((est, tracker, f"{label} ({est.knobs.precision})", extra))  # + held bytes
    out = []
    if args.report:
        from memfit.report.html import step_view, write_report

        views = [step_view(e, t, label=label, allocator=allocator, held_bytes=extra)
                 for e, t, label, extra in steps]
        write_report(args.report, views, title=title, where=where,
                     budget_bytes=planned.plan.budget_bytes, plan=planned.plan)
        out.append(f"report written to {args.report}")
    if args.snapshot:
        from memfit.report.snapshot import write_snapshot

        est, tracker, _, _ = steps[1]
        if tracker is None:
            raise ValueError("--snapshot: the planned step could not be re-traced to the same "
                             "figures; write the snapshot with memfit estimate and the plan's "
                             "knobs")
        write_snapshot(args.snapshot, est, tracker, at=args.snapshot_at, allocator=allocator)
        out.append(f"snapshot of the planned step written to {args.snapshot}")
    return out


def plan_records(args, model, batch, planned, *, optimizer: str, device, allocator=None,
                 loss_fn=None) -> tuple:
    """The trace records of the plain and the planned step (re-traced once per command, shared
    by --plot, --report and --snapshot); None for a step whose re-trace differs."""
    if getattr(args, "_plan_records", None) is None:
        from memfit.report._capture import traced

        args._plan_records = tuple(
            _retrace(model, batch, est, optimizer, device, allocator, loss_fn, traced)
            for est in (planned.plain, planned.chosen))
    return args._plan_records


def _retrace(model, batch, est, optimizer, device, allocator, loss_fn, traced):
    """The trace record of ``est`` by tracing its knobs again; None if the figures differ."""
    from memfit.api.estimate import estimate

    knobs = {k: v for k, v in est.knobs.to_dict().items() if v is not None}
    with traced(model) as cap:
        again = estimate(model, batch, optimizer=optimizer, device=device, loss_fn=loss_fn,
                         budget=est.limit_bytes, allocator=allocator, **knobs)
    same = (again.peak_bytes, again.reserved_bytes, again.timeline) == \
        (est.peak_bytes, est.reserved_bytes, est.timeline)
    return cap.take() if same else None
