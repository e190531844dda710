"""PNG plots (matplotlib, headless Agg backend)."""

from __future__ import annotations

from memfit.measure import CATEGORIES
from memfit.units import GiB

__all__ = ["plot_timeline", "plot_before_after"]

_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c",
           "inputs": "#937860", "activations": "#c44e52", "temporaries": "#da8bc3"}


def plot_timeline(path: str, timeline_by_category: dict[str, list[int]], *,
                  phases: dict[str, int] | None = None, limit_bytes: int | None = None,
                  limit_label: str = "budget", title: str = "") -> str:
    """Stacked live bytes per category over the ops of a step, with phases and the limit."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    _draw(ax, timeline_by_category, phases, limit_bytes, limit_label, title)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    return _save(fig, path)


def plot_before_after(path: str, before, after, *, limit_bytes: int, limit_label: str = "budget",
                      titles: tuple[str, str] = ("before", "after"), suptitle: str = "") -> str:
    """Two steps side by side on one scale (e.g. the plain step and the planned one): each an
    object with ``timeline_by_category`` and ``phases`` (an ``Estimate``)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110, sharey=True)
    for ax, est, title in zip(axes, (before, after), titles):
        _draw(ax, est.timeline_by_category, est.phases, limit_bytes, limit_label, title)
    axes[0].legend(loc="upper left", fontsize=8, ncol=2)
    if suptitle:
        fig.suptitle(suptitle)
    return _save(fig, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _draw(ax, timeline_by_category, phases, limit_bytes, limit_label, title) -> None:
    n = len(next(iter(timeline_by_category.values()), []))
    xs = list(range(n))
    series = [[v / GiB for v in timeline_by_category[c]] for c in CATEGORIES]
    ax.stackplot(xs, *series, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES],
                 linewidth=0)
    if limit_bytes is not None:
        ax.axhline(limit_bytes / GiB, color="red", linewidth=1.2, linestyle="--",
                   label=f"{limit_label} ({limit_bytes / GiB:.2f} GiB)")
    for name, start in (phases or {}).items():
        ax.axvline(start, color="black", linewidth=0.6, linestyle=":")
        ax.text(start, ax.get_ylim()[1] * 0.98, f" {name}", va="top", fontsize=8)
    ax.set_xlabel("op of the training step")
    ax.set_ylabel("live bytes (GiB)")
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_title(title)


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
