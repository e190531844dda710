"""PNG plots (matplotlib, headless Agg backend)."""

from __future__ import annotations

from memfit.measure import CATEGORIES
from memfit.units import GiB

__all__ = ["plot_timeline"]

_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c",
           "inputs": "#937860", "activations": "#c44e52", "temporaries": "#da8bc3"}


def plot_timeline(path: str, timeline_by_category: dict[str, list[int]], *,
                  phases: dict[str, int] | None = None, limit_bytes: int | None = None,
                  limit_label: str = "budget", title: str = "") -> str:
    """Stacked live bytes per category over the ops of a step, with phases and the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    n = len(next(iter(timeline_by_category.values()), []))
    xs = list(range(n))
    series = [[v / GiB for v in timeline_by_category[c]] for c in CATEGORIES]
    ax.stackplot(xs, *series, labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES],
                 linewidth=0)
    for name, start in (phases or {}).items():
        ax.axvline(start, color="black", linewidth=0.6, linestyle=":")
        ax.text(start, ax.get_ylim()[1] * 0.98, f" {name}", va="top", fontsize=8)
    if limit_bytes is not None:
        ax.axhline(limit_bytes / GiB, color="red", linewidth=1.2, linestyle="--",
                   label=f"{limit_label} ({limit_bytes / GiB:.2f} GiB)")
    ax.set_xlabel("op of the training step")
    ax.set_ylabel("live bytes (GiB)")
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
