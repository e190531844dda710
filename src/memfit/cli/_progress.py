"""Progress a person can follow, on a terminal or not (issue 29 item 4).

Note 1 (why). rich's ``Console.status`` draws nothing when the console is not a terminal (a
pipe, a CI log, ``> out.txt``), so a plan of several minutes printed nothing until its answer.
``status(console, message)`` stands in for ``console.status(message)``: on a terminal it is that
spinner, each stage with the seconds so far; off a terminal, once the work has taken 5 s, the
current stage is a line on stderr (``memfit: [  12.3 s] tracing the plain step ...``), again at
each new stage and every 30 s while one lasts, from a daemon thread that stops with the work.
Stdout stays the answer (``--json`` unchanged); work under 5 s prints nothing.

Note 2 (the ETA). A stage numbered by the pipeline (``api._stages.Stage``: this stage's number
and the stages expected in all) is printed with its place and, from the second stage on, the
time left: the seconds per stage so far (from the first stage's start to this one's) times the
stages left, this one included, less what this one has taken. Stages are traces and searches of
about the same cost, so it is "about"; a call that runs more stages than it expected raises the
count as it goes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

__all__ = ["status"]

QUIET_S = 5.0        # off a terminal, nothing is printed before this much time (Note 1)
REPEAT_S = 30.0      # ... and a stage that lasts is printed again this often


class _Eta:
    """The place and time left of numbered stages (Note 2)."""

    def __init__(self):
        self._first: float | None = None      # when stage 1 started
        self._stage: tuple[int, int, float] | None = None    # (number, expected, its start)

    def heard(self, message: str) -> None:
        number, expected = getattr(message, "number", 0), getattr(message, "expected", 0)
        if not number:                   # a stage of the front's own, not numbered
            self._stage = None
            return
        now = time.perf_counter()
        if number == 1 or self._first is None:
            self._first = now
        if self._stage is None or self._stage[0] != number:
            self._stage = (number, expected, now)

    def suffix(self) -> str:
        if self._stage is None:
            return ""
        number, expected, began = self._stage
        place = f"stage {number} of {expected}" if expected else f"stage {number}"
        if number < 2 or self._first is None:
            return f" ({place})"
        per = (began - self._first) / (number - 1)
        left = max(per * (expected - number + 1) - (time.perf_counter() - began), 0.0)
        return f" ({place}, about {_seconds(left)} left)"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"


class _Lines:
    """The current stage as lines on ``stream`` (Note 1), with its ETA (Note 2)."""

    def __init__(self, stream, start: float):
        self.stream, self.start = stream, start
        self.eta = _Eta()
        self._message: str | None = None
        self._printed: str | None = None
        self._last = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def update(self, message: str) -> None:
        with self._lock:
            self.eta.heard(message)
            self._message = message.rstrip(". ")
            self._maybe_print()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                self._maybe_print()

    def _maybe_print(self) -> None:
        elapsed = time.perf_counter() - self.start
        if self._message is None or elapsed < QUIET_S:
            return
        if self._message != self._printed or elapsed - self._last >= REPEAT_S:
            print(f"memfit: [{elapsed:6.1f} s] {self._message}{self.eta.suffix()}",
                  file=self.stream, flush=True)
            self._printed, self._last = self._message, elapsed


class _Spinner:
    """rich's status line, each stage with the seconds so far."""

    def __init__(self, live, start: float):
        self.live, self.start = live, start
        self.eta = _Eta()

    def update(self, message: str) -> None:
        self.eta.heard(message)
        self.live.update(f"{message.rstrip('. ')}{self.eta.suffix()} "
                         f"[{time.perf_counter() - self.start:.0f} s]")


@contextlib.contextmanager
def status(console, message: str):
    """``console.status(message)``, also off a terminal (Note 1); yields an object whose
    ``update(message)`` names the next stage."""
    start = time.perf_counter()
    if console.is_terminal:
        with console.status(message) as live:
            yield _Spinner(live, start)
        return
    lines = _Lines(sys.stderr, start)
    lines.update(message)
    try:
        yield lines
    finally:
        lines.close()
