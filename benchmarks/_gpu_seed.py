"""gpu_check's seed-table section: a slice of ``memfit bench seed`` measured on this GPU.

XLM-R base at length 256, batch 16, fp32 / fp16 AMP x checkpointing off / on, and XLM-R large
fp16 AMP with checkpointing: predicted as ``memfit bench seed`` predicts them (one shared trace
per group, ``memfit.train.seed_table``) and measured as ``memfit bench seed --measure`` measures
them (``memfit.train.seed_measure``), beside each other. Pass marks as gpu_check's: allocated
within 3%, reserved within 5%.
"""

from __future__ import annotations

from rich.table import Table

import _record
import memfit
from memfit.train import seed_table as st

ROWS = [st.Row("xlm-roberta-base", 256, p, c, 16) for p in ("fp32", "fp16")
        for c in ("none", "all")] + [st.Row("xlm-roberta-large", 256, "fp16", "all", 16)]


def seed_check(console, spec, dry_run: bool) -> list[dict]:
    """Predicted (and, unless ``dry_run``, measured) rows; writes ``gpu_seed-<date>.json``."""
    from memfit.train.seed_measure import measure_row

    groups: dict = {}
    for r in ROWS:
        groups.setdefault(st.group_key(r), []).append(r)
    predicted = {}
    with console.status("seed table: predicting"):
        for rows in groups.values():
            predicted.update(zip(rows, st.estimate_group(rows, spec, use_cache=False)))
    out = []
    for r in ROWS:
        row = {**r.__dict__, **predicted[r]}
        if not dry_run:
            with console.status(f"seed table: {r.model} {r.precision} {r.checkpoint} measured"):
                row.update(measure_row(r))
            if not row["measured_oom"]:
                row["allocated_error"] = row["peak_bytes"] / row["measured_allocated_bytes"] - 1
                row["reserved_error"] = row["reserved_bytes"] / row["measured_reserved_bytes"] - 1
                row["pass"] = abs(row["allocated_error"]) <= 0.03 and \
                    abs(row["reserved_error"]) <= 0.05
        out.append(row)
    fmt = memfit.format_bytes
    table = Table(title=f"seed table slice on {spec.display_name}: predicted vs measured, step 2")
    for col in ("row", "pred alloc", "meas alloc", "err", "pred reserved", "meas reserved", "err",
                "pred device", "meas device"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for row in out:
        m = lambda key: fmt(row[key]) if row.get(key) is not None else "-"
        e = lambda key: f"{100 * row[key]:+.1f}%" if key in row else "-"
        table.add_row(f"{row['model']} {row['seq_len']}x{row['batch_size']} {row['precision']} "
                      f"ckpt={row['checkpoint']}", fmt(row["peak_bytes"]),
                      m("measured_allocated_bytes"), e("allocated_error"),
                      fmt(row["reserved_bytes"]), m("measured_reserved_bytes"),
                      e("reserved_error"), fmt(row["device_bytes"]), m("measured_device_bytes"))
    console.print(table)
    if not dry_run:
        path = _record.write("gpu_seed", {"rows": [r.__dict__ for r in ROWS], "gpu": spec.name},
                             out)
        console.print(f"recorded in {path}")
    return out
