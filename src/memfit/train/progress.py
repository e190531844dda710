"""The run's progress bar (``rich``): steps, loss, learning rate, tokens/s, and memory, the
measured peak beside the plan's prediction."""

from __future__ import annotations

__all__ = ["Bar"]


class Bar:
    def __init__(self, console):
        self.console = console
        self._progress = None
        self._task = None

    def start(self, total: int, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
            TimeRemainingColumn

        self._progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                  console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, completed=done, info="")

    def update(self, r: dict) -> None:
        from memfit.units import format_bytes

        mem = ""
        if r.get("peak_bytes") is not None:
            mem = f" mem {format_bytes(r['peak_bytes'])}"
            if r.get("predicted_peak_bytes"):
                mem += f" / {format_bytes(r['predicted_peak_bytes'])} predicted"
        info = (f"loss {r['loss']:.4f} lr {r['lr']:.2e} {r['tokens_per_s']:,.0f} tok/s{mem}")
        self._progress.update(self._task, completed=r["step"], info=info)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
