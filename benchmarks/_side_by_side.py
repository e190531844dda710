"""The table the integration benchmarks print: predicted vs measured peak and the measured time
ratios of each setting, side by side, with the control's ratio under it."""

from __future__ import annotations

from rich.table import Table

import memfit
from _timing import CONTROL

__all__ = ["print_predicted_vs_measured"]

_COLUMNS = ("setting", "plan", "predicted", "measured", "pred - meas", "predicted time",
            "time ratio", "CPU-time ratio")


def print_predicted_vs_measured(console, title: str, rows: list[dict], timings,
                                control_words: str) -> None:
    """Each row (``setting``, ``plan``, ``predicted_peak_bytes``, ``measured_peak_bytes``,
    ``predicted_minus_measured_bytes``, ``predicted_step_time_ratio``) gets its timing fields
    (``timings.row``) and a line of the table; ``control_words`` says what the control ran."""
    table = Table(title=title)
    for col in _COLUMNS:
        table.add_column(col, justify="right")
    for row in rows:
        row.update(timings.row(row["setting"]))
        table.add_row(row["setting"], row["plan"], memfit.format_bytes(row["predicted_peak_bytes"]),
                      memfit.format_bytes(row["measured_peak_bytes"]),
                      f"{row['predicted_minus_measured_bytes']:+d} B",
                      f"{row['predicted_step_time_ratio']:.2f}x",
                      str(timings.ratio(row["setting"])),
                      str(timings.ratio(row["setting"], clock="cpu")))
    console.print(table)
    console.print(f"control ({control_words}): {timings.ratio(CONTROL)} wall, "
                  f"{timings.ratio(CONTROL, clock='cpu')} CPU time")
