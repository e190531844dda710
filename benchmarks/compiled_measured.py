"""docs/compiled.md's "Measured" table: each compiled CPU step's peak by the CPU allocator's
own events beside memfit's estimate of it, row by row, in one run.

    python benchmarks/compiled_measured.py

Each row's real step runs in a fresh process (tests/trace/_compiled_oracle.py: tiny config,
random weights, Inductor, the third step's peak from ``torch.profiler``'s allocator events,
Python's cycle collector off while the steps run); memfit's estimate is made in this one. The
rows are ``_compiled_oracle.ROWS``; ``pytest --runslow tests/trace/test_compiled.py`` holds
each within 1%; this prints the figures. Nothing here is a GPU measurement.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import _record  # noqa: E402
from tests.trace._compiled_oracle import (ROWS, estimated,  # noqa: E402
                                          measured_in_fresh_process)


def main() -> None:
    console = Console()
    table = Table(title="compiled CPU steps: allocator's peak vs memfit's estimate (bytes)")
    for col in ("job", "measured", "memfit", "error"):
        table.add_column(col)
    rows = []
    for job in ROWS:
        real, est = measured_in_fresh_process(job), estimated(job).peak_bytes
        rows.append({"job": job, "measured_bytes": real, "memfit_bytes": est,
                     "error_pct": round(100 * (est - real) / real, 4)})
        label = ", ".join(f"{k}={v}" for k, v in job.items() if k not in ("batch", "seq_len"))
        table.add_row(label, f"{real:,}", f"{est:,}", f"{rows[-1]['error_pct']:+.4f}%")
        console.print(rows[-1])
    console.print(table)
    path = _record.write("compiled_measured", {"threads": torch.get_num_threads(),
                                               "batch": 2, "seq_len": 32}, rows)
    console.print(f"recorded in {path}")


if __name__ == "__main__":
    main()
