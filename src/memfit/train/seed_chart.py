"""The seed table's PNG: device bytes per row as bars, one panel per model, with the GPU's
usable memory as a line; memfit's plan as the last bar of each panel (headless Agg)."""

from __future__ import annotations

__all__ = ["plot_seed_table"]


def plot_seed_table(path: str, results, plans, device) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memfit.units import GiB

    models = sorted({row.model for row, _ in results})
    fig, axes = plt.subplots(len(models), 1, figsize=(13, 4.2 * len(models)), dpi=100,
                             squeeze=False)
    colors = {("fp32", "none"): "#4c72b0", ("fp32", "all"): "#8fb0d9",
              ("fp16", "none"): "#dd8452", ("fp16", "all"): "#f0b88a"}
    for ax, m in zip(axes[:, 0], models):
        rows = [(row, r) for row, r in results if row.model == m]
        labels = [f"{row.seq_len}x{row.batch_size}" for row, _ in rows]
        values = [r["device_bytes"] / GiB for _, r in rows]
        ax.bar(range(len(rows)), values, color=[colors[(row.precision, row.checkpoint)]
                                                for row, _ in rows])
        for name, r in plans:
            if name == m:
                ax.bar(len(rows), r["device_bytes"] / GiB, color="#55a868")
                labels.append("plan")
        ax.axhline(device.usable_bytes / GiB, color="#c44e52", ls="--", lw=1)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=90, fontsize=7)
        ax.set_ylabel("GiB on the device")
        ax.set_title(f"{m} on the {device.display_name}: seq x batch")
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    handles += [plt.Rectangle((0, 0), 1, 1, color="#55a868"),
                plt.Line2D([0], [0], color="#c44e52", ls="--")]
    names = ["fp32", "fp32 + checkpointing", "fp16 AMP", "fp16 AMP + checkpointing",
             "memfit plan", "usable memory"]
    fig.legend(handles, names, loc="upper right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path)
    plt.close(fig)
    return path
