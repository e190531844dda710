"""Measured memory of the run's steps, beside the plan's prediction.

On CUDA: the caching allocator's peak over each step (its statistics reset at the step's start).
On the CPU: ``memfit.track`` (exact live tensor bytes, the counter ``estimate`` is held to) over
each of the first ``steps`` steps, then closed: counting every op costs time, and from the
second step on the steady state repeats. The figure is the highest step measured so far.
"""

from __future__ import annotations

import torch

__all__ = ["StepMemoryMeter"]


class StepMemoryMeter:
    def __init__(self, model, optimizer, steps: int):
        p = next(model.parameters(), None)
        self.cuda = p is not None and p.device.type == "cuda"
        self.left = steps
        self.peak_bytes: int | None = None
        self._tracker = None
        self._args = (model, optimizer)

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.left > 0:
            import memfit

            self._tracker = memfit.track(*self._args)
            self._tracker.__enter__()

    def end(self) -> None:
        if self.cuda:
            measured = torch.cuda.max_memory_allocated()
        elif self._tracker is not None:
            t, self._tracker = self._tracker, None
            t.__exit__(None, None, None)
            measured, self.left = t.peak_bytes, self.left - 1
        else:
            return
        self.peak_bytes = max(self.peak_bytes or 0, measured)

    def abort(self) -> None:
        """A step raised: close the tracker without reading it."""
        if self._tracker is not None:
            t, self._tracker = self._tracker, None
            t.__exit__(None, None, None)

    def release(self) -> None:
        self._args = None
