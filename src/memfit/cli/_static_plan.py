"""``memfit estimate --static-plan`` and ``--static-plan-plot``: the step in one static arena.

The estimate command adds these flags with ``add_arguments`` and calls ``run(args, est, out)``
once its estimate exists: ``out`` is the JSON object being built (``--json``; the plan goes in
under "static_plan") or the console the human report prints on.

Note 1 (the plot). Each storage is a rectangle: op points ``first_op..last_op`` across, its
offset and size up, coloured by category; the lower bound and the caching allocator's
reserved peak are horizontal lines. A step has thousands of storages: they are drawn as one
``PolyCollection``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run", "wanted", "plot_arena"]

_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c",
           "inputs": "#937860", "activations": "#c44e52", "temporaries": "#da8bc3"}


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--static-plan", action="store_true",
                        help="plan every storage of the step in one static arena (memfit.memplan, "
                             "SOMAS-like) and print its size beside the lower bound (peak live "
                             "bytes) and the caching allocator's reserved bytes, and what "
                             "separate pools or expandable_segments would reserve (modelled)")
    parser.add_argument("--static-plan-plot", default=None, metavar="FILE.png", type=_plot_path,
                        help="draw the static arena (offset vs op) to FILE.png; implies "
                             "--static-plan")


def wanted(args) -> bool:
    return bool(getattr(args, "static_plan", False) or getattr(args, "static_plan_plot", None))


def _plot_path(text: str) -> str:
    """The plot's file, checked when the flags are parsed (before any trace)."""
    from memfit.cli._args import check_output_path

    try:
        check_output_path(text, "--static-plan-plot")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--static-plan-plot {text}: ")) \
            from None
    return text


def run(args, est, out) -> None:
    """Plan ``est``'s step and report it on ``out`` (a JSON dict, or a console)."""
    if not wanted(args):
        return
    from memfit.memplan import static_plan

    if getattr(est, "lifetimes", None) is None:
        raise ValueError("--static-plan needs the storages of one traced step, which an "
                         "estimate of one rank of a sharded job does not keep yet: drop "
                         "--gpus/--sharding, or --static-plan")
    plan = static_plan(est, pools=True)
    if args.static_plan_plot:
        plot_arena(args.static_plan_plot, plan, title=f"static arena, {est.device.display_name}")
    if isinstance(out, dict):
        out["static_plan"] = plan.to_dict()
        if args.static_plan_plot:
            out["static_plan"]["plot"] = args.static_plan_plot
        return
    for line in lines(plan, est):
        out.print(line)
    if args.static_plan_plot:
        out.print(f"static arena plot written to {args.static_plan_plot}")


def lines(plan, est) -> list[str]:
    from memfit.units import format_bytes as fb

    modelled = "" if est.basis == "cuda-model" else " (modelled: this step on a GPU)"
    out = [f"static plan of {len(plan.assignments)} storages: arena {fb(plan.arena_bytes)} "
           f"({plan.method}), lower bound (peak live) {fb(plan.lower_bound_bytes)}, caching "
           f"allocator reserved {fb(plan.reserved_bytes)}{modelled}",
           f"  the arena saves {fb(plan.saved_bytes)} of reserved, "
           f"{100 * plan.gap_closed:.1f}% of the gap to the lower bound; greedy by size "
           f"{fb(plan.greedy_by_size_bytes)}, by lifetime {fb(plan.greedy_by_lifetime_bytes)}"]
    if plan.exact is not None:
        out.append(f"  exact (HiGHS, {plan.exact.seconds:.1f} s): {fb(plan.exact.arena_bytes)}"
                   + (" optimal" if plan.exact.optimal else
                      f", bound {fb(plan.exact.bound_bytes)} (time limit)"))
    pools = plan.pools
    if pools is not None:
        out.append("  allocator settings (modelled reserved peak): " + "; ".join(
            f"{o.name} {fb(o.reserved_bytes)}" + ("" if o.applicable else " (no PyTorch setting)")
            for o in pools.options))
        best = pools.best
        out.append(f"  least reserved with PyTorch's settings: {best.name}, saving "
                   f"{fb(pools.saved_bytes)}" + ("" if pools.saved_bytes else
                                                  " (the default is already the best)"))
        out.append("  lifetime classes (peak live): " + ", ".join(
            f"{name} {fb(c['peak_live_bytes'])} in {c['storages']}"
            for name, c in pools.classes.items()))
    return out


def plot_arena(path: str, plan, title: str = "static arena") -> None:
    """Write the arena as offset vs op point to ``path`` (Note 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    unit, name = (1 << 30, "GiB") if plan.arena_bytes >= 1 << 30 else (1 << 20, "MiB")
    fig, ax = plt.subplots(figsize=(11, 5.5))
    polys, colors = [], []
    for a in plan.assignments:
        x0, x1 = a.first_op, a.last_op + 1
        y0, y1 = a.offset / unit, (a.offset + a.size) / unit
        polys.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
        colors.append(_COLORS.get(a.category, "#8c8c8c"))
    ax.add_collection(PolyCollection(polys, facecolors=colors, edgecolors="none"))
    ax.axhline(plan.lower_bound_bytes / unit, color="black", ls=":", lw=1,
               label=f"lower bound (peak live) {plan.lower_bound_bytes / unit:.3g} {name}")
    ax.axhline(plan.arena_bytes / unit, color="black", lw=1,
               label=f"arena {plan.arena_bytes / unit:.3g} {name}")
    ax.axhline(plan.reserved_bytes / unit, color="#b22222", ls="--", lw=1,
               label=f"caching allocator reserved {plan.reserved_bytes / unit:.3g} {name}")
    ax.set_xlim(-1, max(plan.num_ops, 1))
    ax.set_ylim(0, max(plan.reserved_bytes, plan.arena_bytes) / unit * 1.05)
    ax.set_xlabel("op of the step")
    ax.set_ylabel(f"offset in the arena ({name})")
    ax.set_title(title)
    used = sorted({a.category for a in plan.assignments})
    handles = ax.get_legend_handles_labels()[0] + [Patch(color=_COLORS.get(c, "#8c8c8c"), label=c)
                                                    for c in used]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
