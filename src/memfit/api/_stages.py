"""The stages of a long call, numbered, so that a front can print an ETA (issue 29 item 4).

``on_progress(message)`` hears each stage as a ``Stage``: a ``str``, as it always was, that
also carries ``number`` (this stage's, from 1) and ``expected`` (the stages the call expects
in all, never fewer than it has reached; 0 where it does not know). ``Stages`` numbers them for
a call that knows its work ahead (``api._planner``: each trace is a stage, as are the search and the
verify) or not (``api.levers``' bisections: numbered, none expected). A front makes the ETA from the stages done and its own clock (``cli._progress``):
each stage there is a trace or a search of about the same cost, so the time per stage so far
times the stages left is the estimate, and it says "about".
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Stage", "Stages"]


class Stage(str):
    """A progress message with its place among the call's stages."""

    number: int = 0
    expected: int = 0


class Stages:
    """``on_progress`` with each message numbered as a ``Stage``; ``expect(n)`` says that ``n``
    more stages are ahead (from the one to be announced next)."""

    def __init__(self, on_progress: Callable[[str], None] | None):
        self._on_progress = on_progress or (lambda message: None)
        self.number = 0
        self.expected = 0

    def expect(self, n: int) -> None:
        self.expected = max(self.expected, self.number + n)

    def __call__(self, message: str) -> None:
        self.number += 1
        stage = Stage(message)
        stage.number = self.number
        stage.expected = max(self.expected, self.number) if self.expected else 0
        self._on_progress(stage)
