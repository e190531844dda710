"""The table the integration benchmarks print: predicted vs measured peak and the measured time
ratios of each setting, side by side, with the control's ratio under it."""

from __future__ import annotations

from rich.table import Table

import _record
import memfit
from _timing import CONTROL, interleave

__all__ = ["print_predicted_vs_measured", "time_print_and_record"]

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


def time_print_and_record(console, name: str, steps_of: dict, args, title: str,
                          rows: list[dict], control_words: str, config: dict) -> None:
    """Time ``steps_of`` interleaved (``args.rounds`` rounds against the "unplanned" one, one
    warm-up), print the table, and record it under ``name`` with ``config`` and the timings."""
    with console.status("timing interleaved") as status:
        timings = interleave(steps_of, args.rounds, "unplanned", warmup=1,
                             on_round=lambda r, n: status.update(f"timing, round {r + 1}/{n}"))
    print_predicted_vs_measured(console, title, rows, timings, control_words)
    config = {**config, "rounds": args.rounds, "steps": args.steps, "fraction": args.fraction,
              "timing": timings.summary(), "machine_note": _record.SHARED_MACHINE_NOTE}
    console.print(f"recorded in {_record.write(name, config, rows)}")
