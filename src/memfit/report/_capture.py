"""Keep the storage-level record of a trace: ``traced(model)`` around ``memfit.estimate``.

Note 1 (how the record is reached). ``estimate`` returns the step's timeline, not the births and
deaths of each storage, which a memory snapshot needs (``report.snapshot``). The trace's ``Tracker``
has them, and it keeps nothing alive after its block (the model, optimizer and hooks are dropped at
exit), so it can be kept. ``estimate`` deep-copies the model to trace it, forward hooks included
(``trace.fake``): a forward pre-hook on the user's model therefore runs in the traced copy too,
inside the trace's tracker, where ``memfit.measure.track.active_tracker()`` returns it. The hook
only reads; it is removed when the block ends, and the copy carrying it is gone once ``estimate``
returns. The last fake tracker seen is the counted trace (the two-step CUDA trace uses one tracker
for both steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from memfit.measure.track import Tracker, active_tracker

__all__ = ["traced", "Capture"]


class Capture:
    """What ``traced`` saw: ``tracker`` is the last trace's ``Tracker`` (None if none ran)."""

    def __init__(self):
        self.tracker: Tracker | None = None

    def take(self) -> Tracker:
        if self.tracker is None:
            raise ValueError("no traced step was seen: call memfit.estimate on the model given "
                             "to traced(model) inside its block")
        t, self.tracker = self.tracker, None
        return t


@contextlib.contextmanager
def traced(model: nn.Module) -> Iterator[Capture]:
    """``with traced(model) as cap: est = memfit.estimate(model, ...)``; then ``cap.take()`` is
    the trace's tracker (Note 1)."""
    cap = Capture()

    def seen(_module, _args) -> None:     # a function: deepcopy keeps it (and ``cap``) as is
        t = active_tracker(fake=True)
        if t is not None:
            cap.tracker = t

    handle = model.register_forward_pre_hook(seen)
    try:
        yield cap
    finally:
        handle.remove()
