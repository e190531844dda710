"""Progress a person can follow, on a terminal or not (issue 29 item 4).

Note 1 (why). rich's ``Console.status`` draws nothing when the console is not a terminal (a
pipe, a CI log, ``> out.txt``), so a plan of several minutes printed nothing until its answer.
``status(console, message)`` stands in for ``console.status(message)``: on a terminal it is that
spinner, each stage with the seconds so far; off a terminal, once the work has taken 5 s, the
current stage is a line on stderr (``memfit: [  12.3 s] tracing the plain step ...``), again at
each new stage and every 30 s while one lasts, from a daemon thread that stops with the work.
Stdout stays the answer (``--json`` unchanged); work under 5 s prints nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

__all__ = ["status"]

QUIET_S = 5.0        # off a terminal, nothing is printed before this much time (Note 1)
REPEAT_S = 30.0      # ... and a stage that lasts is printed again this often


class _Lines:
    """The current stage as lines on ``stream`` (Note 1)."""

    def __init__(self, stream, start: float):
        self.stream, self.start = stream, start
        self._message: str | None = None
        self._printed: str | None = None
        self._last = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def update(self, message: str) -> None:
        with self._lock:
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
            print(f"memfit: [{elapsed:6.1f} s] {self._message}", file=self.stream, flush=True)
            self._printed, self._last = self._message, elapsed


class _Spinner:
    """rich's status line, each stage with the seconds so far."""

    def __init__(self, live, start: float):
        self.live, self.start = live, start

    def update(self, message: str) -> None:
        self.live.update(f"{message} [{time.perf_counter() - self.start:.0f} s]")


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
