"""``MemfitPlan``: a Lightning ``Callback`` that estimates, plans and applies memfit at
``on_fit_start`` and compares the prediction with the first steps of the real run.

Note 1 (when). At ``on_fit_start`` the strategy has set up the module and its optimizer
(``trainer.optimizers``) and no batch has run. The step is traced as Lightning's automatic
optimization runs it (``_lightning_step``), with the Trainer's own settings (``LoopSettings.of``),
on ``batch`` or, by default, the first batch of the train dataloader (moved to the device by the
strategy); a dataloader without a length is read one batch ahead by Lightning, so its look-ahead is
counted too. Reading that batch draws the DataLoader's base seed from the global RNG: the RNG state
is put back afterwards, so the run draws what it would have without memfit (same dropout masks, same
shuffling).

Note 2 (applying). With a ``budget`` the step is planned (``memfit.plan(step=fn)``: per-block
keep / recompute / selective / offload and the optimizer state's placement) and applied with
``_apply.apply_plan``: block hooks on the module, and an offloaded optimizer set as
``trainer.strategy.optimizers`` (the strategy's own setter, which also rebuilds its
``LightningOptimizer`` wrappers), before the first batch. An LR scheduler configured on the
optimizer would drive the replaced one, so optimizer offload is then not considered (and the
plan's notes say so). The plan stays applied after ``fit``; ``callback.changes.remove()`` takes
it off.

Note 3 (measured). Each of the first ``steps`` optimizer steps (``accumulate_grad_batches``
batches each) is measured from the ``on_train_batch_start`` of its first batch to the
``on_train_batch_end`` of its last: on CUDA the allocator's peak (stats reset at its start); on
CPU a ``memfit.track`` opened at ``on_train_start``, closed after the last measured step. Step 1
(no optimizer state yet) is logged, not compared; from step 2 on a measured peak more than
``tolerance`` away from the predicted one warns (as ``transformers.MemfitCallback`` does).
"""

from __future__ import annotations

import logging
import warnings

import torch
from lightning.pytorch import Callback

from memfit.api.estimate import estimate as _estimate
from memfit.api.plan import plan as _plan
from memfit.integrations._apply import Changes, apply_plan
from memfit.integrations._measure import StepMemory, StepMeter
from memfit.integrations._lightning_step import (LightningStep, LoopSettings, check_module,
                                                 detached, traced_batch)
from memfit.units import format_bytes, parse_bytes

__all__ = ["MemfitPlan"]

logger = logging.getLogger("memfit.integrations.lightning")


class MemfitPlan(Callback):
    """Estimate (and with ``budget``, plan and apply) at ``on_fit_start``; log predicted vs
    measured peak at the first ``steps`` optimizer steps and warn past ``tolerance`` (Notes 1-3).

    ``budget``: device bytes or "11GiB" (None: estimate and measure only). ``batch``: the batch
    to trace (default: the train dataloader's first). ``device``: a GPU name, "cpu" or a
    ``DeviceSpec`` (default: where the module is). ``knobs`` fix choices of the plan (e.g.
    ``offload_optimizer=False``). After ``on_fit_start``: ``predicted_peak_bytes``,
    ``changes`` (a plan's ``Changes``, or None), and ``records`` (a ``StepMemory`` per
    measured step)."""

    def __init__(self, budget=None, batch=None, *, device=None, steps: int = 3,
                 tolerance: float = 0.05, verbose: bool = True, **knobs):
        if not (isinstance(steps, int) and steps >= 2):
            raise ValueError(f"steps={steps!r}: measure at least 2 steps (step 1 has no "
                             "optimizer state yet)")
        if not 0 < tolerance < 1:
            raise ValueError(f"tolerance={tolerance!r}: a fraction, e.g. 0.05")
        self.budget_bytes = None if budget is None else parse_bytes(budget)
        self.batch, self.device, self.knobs = batch, device, knobs
        self.steps, self.tolerance, self.verbose = steps, tolerance, verbose
        self.predicted_peak_bytes: int | None = None
        self.changes: Changes | None = None
        self.records: list[StepMemory] = []
        self._meter = StepMeter()

    # -- on_fit_start: estimate, plan, apply (Notes 1, 2) --------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):      # Note 1: the run's random stream
            self._fit_start(trainer, pl_module)

    def _fit_start(self, trainer, pl_module) -> None:
        check_module(pl_module)
        if len(trainer.optimizers) != 1:
            raise ValueError(f"the trainer has {len(trainer.optimizers)} optimizers: memfit "
                             "traces automatic optimization with one")
        settings = LoopSettings.of(trainer)
        batch, look_ahead = self._batch(trainer)
        traced = traced_batch(batch, settings, look_ahead)
        optimizer, step = trainer.optimizers[0], LightningStep(settings)
        if self.budget_bytes is None:
            with detached(pl_module):
                est = _estimate(pl_module, traced, optimizer=optimizer, device=self.device,
                                step=step, **self.knobs)
            self.predicted_peak_bytes = est.peak_bytes
            logger.info("memfit: predicted peak %s", format_bytes(est.peak_bytes))
            return
        knobs = dict(self.knobs)
        if trainer.lr_scheduler_configs:
            if knobs.get("offload_optimizer"):
                raise ValueError("offload_optimizer=True: an LR scheduler is configured on the "
                                 "optimizer and would drive the replaced one; leave it unset")
            knobs["offload_optimizer"] = False
        with detached(pl_module):
            p = _plan(pl_module, traced, self.budget_bytes, optimizer=optimizer,
                      device=self.device, step=step, **knobs)
        self.changes = apply_plan(p, pl_module, optimizer, self.budget_bytes,
                                  swap=lambda new: _swap(trainer.strategy, optimizer, new))
        if trainer.lr_scheduler_configs:
            self.changes.notes.append("optimizer offload not considered: an LR scheduler is "
                                      "configured on the optimizer")
        self.predicted_peak_bytes = p.predicted_peak_bytes
        if self.verbose:
            print(self.changes)

    def _batch(self, trainer):
        """The batch to trace and whether Lightning reads one ahead (Note 1)."""
        from lightning.fabric.utilities.data import has_len
        source = trainer.fit_loop._data_source
        loader = source.dataloader() if source.is_defined() else None
        look_ahead = loader is not None and not has_len(loader)
        if self.batch is not None:
            return self.batch, look_ahead
        if loader is None:
            raise ValueError("MemfitPlan: the trainer has no train dataloader yet; pass "
                             "MemfitPlan(batch=...)")
        batch = next(iter(loader))
        return trainer.strategy.batch_to_device(batch), look_ahead

    # -- measurement (Note 3) --------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        self.records = []
        self._meter.open(pl_module, trainer.optimizers[0])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        g = trainer.accumulate_grad_batches
        if batch_idx % g or batch_idx // g >= self.steps:
            return
        self._meter.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        g = trainer.accumulate_grad_batches
        step = (batch_idx + 1) // g
        if (batch_idx + 1) % g or step > self.steps or self.predicted_peak_bytes is None:
            return
        rec = self._meter.end(step, self.predicted_peak_bytes)
        if rec is None:
            return
        if step == self.steps:
            self._meter.close()
        self.records.append(rec)
        self._report(rec)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._meter.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._meter.close()

    def _report(self, rec: StepMemory) -> None:
        line = (f"memfit step {rec.step}: predicted peak {format_bytes(rec.predicted_peak_bytes)}"
                f", measured {format_bytes(rec.measured_peak_bytes)} ({rec.error:+.1%})")
        logger.info(line)
        if rec.step >= 2 and abs(rec.error) > self.tolerance:
            warnings.warn(f"{line}: the measurement differs from memfit's prediction by more "
                          f"than {self.tolerance:.0%}. Pass MemfitPlan(batch=...) with a batch "
                          "shaped like the run's (the first batch of the dataloader was traced)",
                          stacklevel=2)


def _swap(strategy, old, new):
    """``new`` as the strategy's optimizer (Note 2); returns the undo."""
    strategy.optimizers = [new if o is old else o for o in strategy.optimizers]
    return lambda: setattr(strategy, "optimizers",
                           [old if o is new else o for o in strategy.optimizers])
