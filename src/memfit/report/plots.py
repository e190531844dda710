"""PNG plots of a traced step (matplotlib, headless Agg backend).

Note 1 (what the curve is). The plot shows what the verdict is about: device bytes. On a CPU
target they are the live tensor bytes, so the top of the stack is the verdict's curve and its
maximum is ``est.device_bytes``. On a GPU target the stack is the live (allocated) bytes over
the CUDA context band; what the card holds is the caching allocator's reservation plus the
context, and the trace knows that only at the peak (one number, ``est.device_bytes``): it is
drawn as a level, labelled as such, not as a curve it does not have.

Note 2 (a one-op peak stays visible). A step has thousands of ops and the figure ~1000 pixel
columns; a downsampled line drops a peak that lasts one op. The ops are cut into at most
``_BUCKETS`` runs and each run is drawn, as a step, at its highest op (with that op's split by
category), so the drawn maximum is the true maximum, and the peak op is marked.

Note 3 (markers and legend). Phases (forward / backward / optimizer) and the start of each
micro-batch are vertical lines with labels; the legend sits outside the axes, right of them,
so it covers no data.

Note 4 (allocated, not only live). On a GPU target the verdict's allocated peak is the caching
allocator's (512-byte rounding, unsplit blocks, cuBLAS workspaces), above the live tensor bytes.
Given the trace's record (``report._capture``), the stack is the allocator replay op by op
(``report._replay``, the same replay as ``CudaModel``'s), whose maximum is ``est.peak_bytes``;
without it, the live bytes, labelled so.
"""

from __future__ import annotations

from memfit.measure import CATEGORIES
from memfit.report._view import envelope, step_view
from memfit.units import GiB, MiB, format_bytes

__all__ = ["plot_timeline", "plot_before_after", "timeline_figure", "before_after_figure",
           "micro_batch_starts"]

_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c",
           "inputs": "#937860", "activations": "#c44e52", "temporaries": "#da8bc3"}
_CONTEXT_COLOR = "#d9d9d9"
_BUCKETS = 1200
DEVICE_CURVE_LABEL = "device bytes"      # the line whose maximum is the verdict (CPU target)
RESERVED_LEVEL_LABEL = "reserved + context at the peak"   # the verdict's level (GPU target)


def micro_batch_starts(est) -> list[int]:
    """First op of each micro-batch's forward (empty for one micro-batch). The trace marks only
    the first forward; the root module's record holds the start of the last one, and the
    micro-batches in between run the same ops, so the starts are evenly spaced between."""
    root = est.modules.get("") if est.modules else None
    first = est.phases.get("forward")
    if root is None or first is None or root.fw_span is None or root.calls < 2:
        return []
    last, n = root.fw_span[0], root.calls
    return [round(first + i * (last - first) / (n - 1)) for i in range(n)]


def _unit(max_bytes: float) -> tuple[str, int]:
    return ("GiB", GiB) if max_bytes >= GiB else ("MiB", MiB)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _curve(est, record) -> tuple[list[int], dict[str, list[int]], bool]:
    """The allocated bytes per op and by category, and whether they are the verdict's own
    (Note 4): with the trace's record, the allocator replay op by op (``report._view``)."""
    if record is not None:
        view = step_view(est, record)
        return view.allocated, view.by_category, True
    return est.timeline, est.timeline_by_category, est.basis != "cuda-model"


def _draw(ax, est, limit_bytes, limit_label, title, unit, record=None) -> float:
    """One step on ``ax`` (Notes 1-4); ``unit``: (name, bytes) of the y axis. Returns the top
    of the y range it needs (everything drawn, with room for the labels)."""
    name, size = unit
    timeline, by_category, exact = _curve(est, record)
    context = est.context_bytes if est.basis == "cuda-model" else 0
    picks = envelope(timeline, _BUCKETS)
    n = len(timeline)
    xs = picks + [n]                       # steps: run j spans [xs[j], xs[j + 1])
    base = [context / size] * len(xs)
    if context:
        ax.fill_between(xs, 0, base, step="post", color=_CONTEXT_COLOR, linewidth=0,
                        label=f"CUDA context ({format_bytes(context)})")
    for c in CATEGORIES:
        values = by_category[c]
        layer = [b + values[i] / size for b, i in zip(base, picks)] + [0]
        layer[-1] = layer[-2] if len(layer) > 1 else 0
        ax.fill_between(xs, base, layer, step="post", color=_COLORS[c], linewidth=0, label=c)
        base = layer
    top = [(timeline[i] + context) / size for i in picks]
    curve = ("allocated (caching-allocator model)" if exact else "live tensors") + \
        (" + CUDA context" if context else "")
    ax.plot(xs, top + top[-1:], drawstyle="steps-post", color="black", linewidth=0.7,
            label=f"{DEVICE_CURVE_LABEL} ({curve})" if not context else curve)
    peak_op = max(range(n), key=timeline.__getitem__)
    peak = (timeline[peak_op] + context) / size
    ax.plot([peak_op], [peak], marker="v", color="black", markersize=6, linestyle="none")
    op = est.op_log[peak_op].removeprefix("aten.") if est.op_log else ""
    ax.annotate(f"peak {format_bytes(timeline[peak_op] + context)}\nop {peak_op} {op}",
                (peak_op, peak), textcoords="offset points", xytext=(4, 6), fontsize=7)
    if context:                                    # Note 1: the verdict is one number here
        ax.axhline(est.device_bytes / size, color="black", linewidth=1.2, linestyle="-.",
                   label=f"{RESERVED_LEVEL_LABEL}\n({format_bytes(est.device_bytes)}; known at "
                         "the peak only)")
    if limit_bytes is not None:
        ax.axhline(limit_bytes / size, color="red", linewidth=1.2, linestyle="--",
                   label=f"{limit_label} ({format_bytes(limit_bytes)})")
    trans = ax.get_xaxis_transform()                # x in ops, y in axes fraction
    for i, start in enumerate(micro_batch_starts(est)[1:], start=2):
        ax.axvline(start, color="#555555", linewidth=0.6, linestyle=(0, (4, 3)),
                   label="micro-batch start" if i == 2 else None)
        ax.text(start, 0.945, f" mb {i}", transform=trans, va="top", fontsize=7, color="#555555")
    for phase, start in (est.phases or {}).items():
        ax.axvline(start, color="black", linewidth=0.8, linestyle=":")
        ax.text(start, 0.99, f" {phase}", transform=trans, va="top", fontsize=8)
    ax.set_xlabel("op of the training step")
    ax.set_ylabel(f"device bytes ({name})")
    ax.set_xlim(0, max(n, 1))
    top = max(peak, est.device_bytes / size, (limit_bytes or 0) / size) * 1.12
    ax.set_ylim(0, top)
    ax.set_title(title)
    return top


def timeline_figure(est, *, limit_bytes: int | None = None, limit_label: str = "budget",
                    title: str = "", record=None):
    """The figure of one step (an ``Estimate``): stacked bytes by category, the device-bytes
    curve (or level, on a GPU target), the limit, phases and micro-batches (module Notes);
    ``record``: the trace's record (``report._capture``), for the allocator's curve (Note 4)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.8), dpi=110, layout="constrained")
    unit = _unit(max(est.device_bytes, limit_bytes or 0))
    _draw(ax, est, limit_bytes, limit_label, title, unit, record)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    return fig


def before_after_figure(before, after, *, limit_bytes: int, limit_label: str = "budget",
                        titles: tuple[str, str] = ("before", "after"), suptitle: str = "",
                        records: tuple = (None, None)):
    """Two steps side by side on one scale (e.g. the plain step and the planned one);
    ``records``: each step's trace record, for the allocator's curve on a GPU target (Note 4)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), dpi=110, sharey=True,
                             layout="constrained")
    unit = _unit(max(before.device_bytes, after.device_bytes, limit_bytes or 0))
    tops = [_draw(ax, est, limit_bytes, limit_label, title, unit, record)
            for ax, est, title, record in zip(axes, (before, after), titles, records)]
    axes[0].set_ylim(0, max(tops))            # shared: the higher step decides
    handles: dict = {}
    for ax in axes:                          # one legend entry per label, both panels
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8)
    if suptitle:
        fig.suptitle(suptitle)
    return fig


def plot_timeline(path: str, est, **kwargs) -> str:
    """Write ``timeline_figure(est, **kwargs)`` to ``path`` (format from its suffix)."""
    return _save(timeline_figure(est, **kwargs), path)


def plot_before_after(path: str, before, after, **kwargs) -> str:
    """Write ``before_after_figure(before, after, **kwargs)`` to ``path``."""
    return _save(before_after_figure(before, after, **kwargs), path)


def _save(fig, path: str) -> str:
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
