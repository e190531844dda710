"""The run's PNG plots from its metrics: loss (and evaluation AUC) over steps, and memory
(measured peak vs the plan's prediction, and the budget) over steps. Headless (Agg), in the
style of ``memfit.report.plots``."""

from __future__ import annotations

import os

__all__ = ["plot_run"]


def plot_run(records: list[dict], folder: str, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memfit.units import MiB

    steps = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    written = []
    if steps:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="#4c72b0",
                lw=1.2, label="training loss")
        ax.set_xlabel("step (effective batch)")
        ax.set_ylabel("loss")
        if evals:
            ax2 = ax.twinx()
            ax2.plot([r["step"] for r in evals], [r["eval_auc"] for r in evals], "o-",
                     color="#c44e52", label="eval ROC AUC")
            ax2.set_ylabel("eval ROC AUC")
            ax2.set_ylim(0, 1)
            ax2.legend(loc="upper right", frameon=False)
        ax.legend(loc="upper left", frameon=False)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        written.append(_save(fig, os.path.join(folder, "loss.png"), plt))
    measured = [r for r in steps if r.get("peak_bytes") is not None]
    if measured:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        ax.plot([r["step"] for r in measured], [r["peak_bytes"] / MiB for r in measured], "o-",
                color="#dd8452", label="measured peak (highest so far)")
        pred = steps[0].get("predicted_peak_bytes")
        if pred:
            ax.axhline(pred / MiB, color="#55a868", ls="--", label="predicted peak (plan)")
        budget = steps[0].get("budget_bytes")
        if budget:
            ax.axhline(budget / MiB, color="#c44e52", ls=":", label="budget")
        ax.set_xlabel("step (effective batch)")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", frameon=False)
        written.append(_save(fig, os.path.join(folder, "memory.png"), plt))
    return written


def _save(fig, path: str, plt) -> str:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
