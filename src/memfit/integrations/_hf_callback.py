"""``MemfitCallback``: predicted vs measured peak of the first steps of ``trainer.train()``.

Note 1 (what is measured). Each of the first ``steps`` optimizer steps is measured from its
``on_step_begin`` to its ``on_step_end``. On CUDA: the caching allocator's
``max_memory_allocated`` / ``max_memory_reserved`` over the step (peak stats reset at its start),
and, when ``pynvml`` imports, the device's used memory at its end (every process and the CUDA
context included). On CPU: a ``memfit.track`` opened at ``on_train_begin``, so everything the
loop makes is counted from its birth, and read over each step; it is closed after the last
measured step, and the rest of the run is not slowed down.

Note 2 (what is compared). The prediction is for the steady state (optimizer state existing): step
1, which creates that state, is logged but not compared. From step 2 on, the measured allocated peak
is compared with the predicted one, and on CUDA the reserved bytes with the predicted reserved
bytes; a difference above ``tolerance`` (5%) of the prediction warns. Two exceptions, one each way.
A CPU ``Estimate`` is exact (the trace counts what the run does), so a step above it by any byte
warns: a budget set from it would be overrun (a step 3.2% over said nothing). An estimate of the
longest step the dataloader can produce (the default for samples of different lengths, said in its
notes) is a bound: steps below it by more than the tolerance are shorter batches, not a miss, and
stay quiet.
"""

from __future__ import annotations

import logging
import warnings

from transformers import TrainerCallback

from memfit.integrations._measure import StepMemory, StepMeter
from memfit.units import format_bytes

__all__ = ["MemfitCallback", "StepMemory"]

logger = logging.getLogger("memfit.integrations.transformers")


class MemfitCallback(TrainerCallback):
    """Logs predicted vs measured peak at the first ``steps`` steps; warns past ``tolerance``.

    ``predicted``: an ``Estimate`` (``estimate(trainer)``), the ``Changes`` of ``fit``, or the
    predicted allocated peak in bytes. ``records`` holds a ``StepMemory`` per measured step."""

    def __init__(self, predicted, steps: int = 3, tolerance: float = 0.05):
        est = getattr(predicted, "estimate", predicted)           # Changes -> its Estimate
        if isinstance(est, bool) or not isinstance(est, int) and not hasattr(est, "peak_bytes"):
            raise ValueError(f"predicted={type(predicted).__name__}: give estimate(trainer), the "
                             "Changes of fit(trainer, ...) or the predicted peak in bytes (int)")
        self.peak_bytes = est if isinstance(est, int) else est.peak_bytes
        self.reserved_bytes = None if isinstance(est, int) or est.device.kind != "cuda" else \
            est.reserved_bytes
        if not (isinstance(steps, int) and steps >= 2):
            raise ValueError(f"steps={steps!r}: measure at least 2 steps (step 1 has no "
                             "optimizer state yet, Note 2)")
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance={tolerance!r}: a fraction, e.g. 0.05")
        self.steps, self.tolerance = steps, tolerance
        cpu = not isinstance(est, int) and est.device.kind == "cpu"
        self.over_tolerance = 0.0 if cpu else tolerance                   # Note 2
        self.bound = not isinstance(est, int) and \
            any(n.startswith("batch: the longest step") for n in est.notes)
        self.records: list[StepMemory] = []
        self._meter = StepMeter()

    # -- events ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.records = []
        self._meter.open(model, getattr(optimizer, "optimizer", optimizer))

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step >= self.steps:
            return
        self._meter.begin()

    def on_step_end(self, args, state, control, **kw):
        step = state.global_step
        if step > self.steps or not self._meter.measuring:
            return
        rec = self._meter.end(step, self.peak_bytes, self.reserved_bytes)
        if step == self.steps:
            self._meter.close()
        self.records.append(rec)
        self._report(rec)

    def on_train_end(self, args, state, control, **kw):
        self._meter.close()

    # -- internals --------------------------------------------------------------------------
    def _report(self, rec: StepMemory) -> None:
        line = (f"memfit step {rec.step}: predicted peak {format_bytes(rec.predicted_peak_bytes)}"
                f", measured {format_bytes(rec.measured_peak_bytes)} ({rec.error:+.1%})")
        if rec.measured_reserved_bytes is not None:
            line += f"; reserved {format_bytes(rec.measured_reserved_bytes)}"
            if rec.predicted_reserved_bytes is not None:
                line += f" (predicted {format_bytes(rec.predicted_reserved_bytes)})"
        if rec.nvml_used_bytes is not None:
            line += f"; NVML used {format_bytes(rec.nvml_used_bytes)}"
        logger.info(line)
        if rec.step < 2:               # no optimizer state yet (Note 2)
            return
        over = rec.error > self.over_tolerance                 # Note 2
        under = rec.error < -self.tolerance and not self.bound
        off = [f"allocated {rec.error:+.1%}"] if over or under else []
        if rec.predicted_reserved_bytes and rec.measured_reserved_bytes is not None:
            r = (rec.measured_reserved_bytes - rec.predicted_reserved_bytes) / \
                rec.predicted_reserved_bytes
            if abs(r) > self.tolerance:
                off.append(f"reserved {r:+.1%}")
        if off:
            warnings.warn(f"{line}: the measurement differs from memfit's prediction "
                          f"({', '.join(off)}). Re-estimate with the "
                          "batch the run takes (estimate(trainer, batch=...))", stacklevel=2)
