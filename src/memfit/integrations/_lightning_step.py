"""One optimizer step of Lightning's automatic optimization as a memfit user step (``step=fn``).

Note 1 (what a step of ``Trainer.fit`` is, Lightning 2.x, automatic optimization). For each
batch ``i`` of the ``accumulate_grad_batches`` of one optimizer step, Lightning builds a
``Closure``: the module's ``training_step(batch, i)`` under the precision plugin's
``train_step_context`` (autocast under "bf16-mixed"), its loss divided by the accumulation
count (``ClosureResult``: a new tensor even when it is 1, plus a detached clone), then on the
first batch of the step ``optimizer_zero_grad`` (``set_to_none``: last step's gradients are
alive through this forward), then ``backward``. The closure runs alone while accumulating; on the
last batch the module's ``optimizer_step`` hands it to ``optimizer.step(closure)``, which runs
it, then ``on_before_optimizer_step`` and gradient clipping (``gradient_clip_val``, by norm or
value), then the update. ``LightningStep`` runs exactly that with Lightning's own ``Closure``
and ``ClosureResult`` and the module's own hooks, on the fakes memfit passes in.

Note 2 (the data). Lightning's data fetcher (``_PrefetchDataFetcher``) reads one batch ahead
only from a dataloader without a length (an ``IterableDataset``); from a sized one the current
batch alone is alive (the previous one has died with the loop's reference to it). The traced
batch is ``{MICRO: [batch] * accumulate_grad_batches}``: one batch's tensors used for each
micro-batch (the shapes a dataloader repeats), plus ``AHEAD``, a copy of it, with
``look_ahead``.

Note 3 (no trainer on the copy). The trace receives a fake deep copy of the module; a module
attached to a trainer would copy the trainer with it, so ``detached`` takes the trainer off for
the copy and puts it back. On the copy ``self.log`` does nothing (Lightning warns once), and a
``configure_gradient_clipping`` of the module's own cannot run (it needs the trainer): it is
refused. Manual optimization (``automatic_optimization = False``) is refused too: its
``training_step`` calls ``self.optimizers()``, which needs the trainer.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["LoopSettings", "LightningStep", "traced_batch", "module_optimizer", "detached",
           "MICRO", "AHEAD"]

MICRO = "micro_batches"
AHEAD = "look_ahead"


@dataclass(frozen=True)
class LoopSettings:
    """The Trainer arguments that shape a step (Note 1)."""

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None      # None or 0: no clipping
    gradient_clip_algorithm: str = "norm"       # "norm" | "value"
    precision: str = "32-true"                  # "32-true" | "bf16-mixed" (Lightning's names)

    def __post_init__(self):
        if not isinstance(self.accumulate_grad_batches, int) or self.accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches={self.accumulate_grad_batches!r}: give an "
                             "int >= 1")
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={self.gradient_clip_algorithm!r}: give "
                             "'norm' or 'value'")
        if self.precision not in ("32-true", "32", 32, "bf16-mixed"):
            raise ValueError(f"precision={self.precision!r}: memfit traces Lightning's "
                             "'32-true' and 'bf16-mixed' (16-mixed needs a GradScaler over the "
                             "real optimizer); use one of those")

    @classmethod
    def of(cls, trainer) -> "LoopSettings":
        """The settings of a ``lightning.Trainer``."""
        algorithm = trainer.gradient_clip_algorithm
        return cls(accumulate_grad_batches=trainer.accumulate_grad_batches,
                   gradient_clip_val=trainer.gradient_clip_val,
                   gradient_clip_algorithm=str(getattr(algorithm, "value", algorithm or "norm")),
                   precision=trainer.precision_plugin.precision)

    def precision_plugin(self):
        from lightning.pytorch.plugins.precision import MixedPrecision, Precision
        if self.precision == "bf16-mixed":
            return MixedPrecision("bf16-mixed", device="cpu")
        return Precision()


def traced_batch(batch, settings: LoopSettings, look_ahead: bool = False) -> dict:
    """Note 2's batch."""
    out = {MICRO: [batch] * settings.accumulate_grad_batches}
    if look_ahead:
        out[AHEAD] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batch)
    return out


def module_optimizer(module) -> torch.optim.Optimizer:
    """The one optimizer ``configure_optimizers`` returns (a fresh one, no state)."""
    from lightning.pytorch.core.optimizer import _configure_optimizers
    optimizers, _, _ = _configure_optimizers(module.configure_optimizers())
    if len(optimizers) != 1:
        raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers: memfit "
                         "traces automatic optimization with one optimizer")
    return optimizers[0]


def check_module(module) -> None:
    """Note 3's refusals."""
    import lightning.pytorch as pl
    if not isinstance(module, pl.LightningModule):
        raise ValueError(f"give a lightning.LightningModule, got {type(module).__name__}")
    if not module.automatic_optimization:
        raise ValueError("automatic_optimization=False: manual optimization calls "
                         "self.optimizers(), which needs the trainer; memfit traces automatic "
                         "optimization only (use memfit.estimate(step=fn) with your own step)")
    own = type(module).configure_gradient_clipping
    if own is not pl.LightningModule.configure_gradient_clipping:
        raise ValueError(f"{type(module).__name__}.configure_gradient_clipping is overridden: it "
                         "needs the trainer, which a trace does not have; clip with the Trainer's "
                         "gradient_clip_val instead")


@contextlib.contextmanager
def detached(module):
    """The module without its trainer while memfit copies it (Note 3)."""
    trainer = module._trainer
    module._trainer = None
    try:
        yield module
    finally:
        module._trainer = trainer


class LightningStep:
    """``fn(module, batch, optimizer)``: one optimizer step of automatic optimization (Note 1)."""

    def __init__(self, settings: LoopSettings):
        self.settings = settings
        self.plugin = settings.precision_plugin()
        self.__qualname__ = "LightningModule.training_step"

    def __call__(self, module, batch, optimizer):
        from lightning.pytorch.loops.optimization.automatic import Closure
        micro = batch[MICRO]
        _touch(batch)                  # alive all step, counted from the start (Note 2)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*self.log.*")
            for i, b in enumerate(micro):
                closure = Closure(step_fn=partial(self._training_step, module, b, i),
                                  backward_fn=partial(self._backward, module),
                                  zero_grad_fn=partial(self._zero_grad, module, i, optimizer)
                                  if i == 0 else None)
                if i < len(micro) - 1:
                    closure()
                else:
                    module.optimizer_step(0, i, optimizer,
                                          partial(self._wrap_closure, module, optimizer, closure))
                closure.consume_result().asdict()
        return None

    def _training_step(self, module, batch, i):
        from lightning.pytorch.loops.optimization.automatic import ClosureResult
        with self.plugin.train_step_context():
            out = module.training_step(batch, i)
        return ClosureResult.from_training_step_output(out, self.settings.accumulate_grad_batches)

    def _zero_grad(self, module, i, optimizer):
        module.on_before_zero_grad(optimizer)
        module.optimizer_zero_grad(0, i, optimizer)

    def _backward(self, module, loss):
        module.on_before_backward(loss)
        module.backward(loss)
        module.on_after_backward()

    def _wrap_closure(self, module, optimizer, closure):
        """The precision plugin's ``_wrap_closure``: the closure, then the hook and clipping."""
        result = closure()
        module.on_before_optimizer_step(optimizer)
        s = self.settings
        if s.gradient_clip_val:
            from lightning.pytorch.utilities import GradClipAlgorithmType
            self.plugin.clip_gradients(optimizer, s.gradient_clip_val,
                                       GradClipAlgorithmType(s.gradient_clip_algorithm))
        return result


def _touch(batch) -> None:
    """A view of every tensor of the traced batch: a tracker counts a storage alive before the
    trace from the first op that sees it, and the look-ahead batch is seen by no other op."""
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            t.detach()
