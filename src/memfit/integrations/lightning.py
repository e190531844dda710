"""Lightning: estimate, plan and apply memfit to ``lightning.Trainer.fit``.

```python
from memfit.integrations import lightning as mf_pl
est = mf_pl.estimate(module, batch, accumulate_grad_batches=2)   # one steady-state step
trainer = lightning.Trainer(max_steps=1000, accumulate_grad_batches=2,
                            callbacks=[mf_pl.MemfitPlan(budget="11GiB")])
trainer.fit(module, dataloader)        # planned at on_fit_start; predicted vs measured logged
```

``estimate`` traces Lightning's automatic optimization as ``fit`` runs it (``_lightning_step``: the
step, the data fetcher's look-ahead, no trainer on the copy) through ``memfit.estimate(step=fn)``;
``MemfitPlan`` plans it with ``memfit.plan(step=fn)`` at ``on_fit_start`` and applies the plan
(``_lightning_callback``).
"""

from __future__ import annotations

try:
    import lightning as _lightning  # noqa: F401  (the dependency itself)
except ImportError as e:      # pragma: no cover - exercised only without lightning
    raise ImportError("memfit.integrations.lightning needs Lightning: "
                      "pip install memfit[lightning]") from e

from memfit.api.estimate import Estimate
from memfit.api.estimate import estimate as _estimate
from memfit.integrations._lightning_callback import MemfitPlan
from memfit.integrations._lightning_step import (LightningStep, LoopSettings, check_module,
                                                 detached, module_optimizer, traced_batch)

__all__ = ["estimate", "MemfitPlan", "LoopSettings"]


def estimate(module, batch, *, trainer=None, accumulate_grad_batches: int = 1,
             gradient_clip_val: float | None = None, gradient_clip_algorithm: str = "norm",
             precision: str = "32-true", look_ahead: bool = False, optimizer=None, device=None,
             budget=None, **knobs) -> Estimate:
    """Predict one steady-state optimizer step of ``Trainer.fit(module)`` (``_lightning_step``).

    ``batch``: one batch as the train dataloader yields it (the module's ``training_step``
    receives it). The Trainer arguments that shape the step are given as keywords
    (``accumulate_grad_batches``, ``gradient_clip_val``, ``gradient_clip_algorithm``,
    ``precision``: "32-true" or "bf16-mixed"), or read from ``trainer``. ``look_ahead``: count
    the batch Lightning's fetcher reads ahead from a dataloader without a length (an
    ``IterableDataset``; from a sized one it reads none).
    ``optimizer``: default, the trainer's (during fit) or a fresh one from the module's
    ``configure_optimizers``. ``knobs``: what memfit adds through the module and the optimizer
    (``checkpoint``, ``offload``, ``offload_optimizer``, ``optimizer_impl``). The module is
    not changed."""
    check_module(module)
    settings = LoopSettings.of(trainer) if trainer is not None else LoopSettings(
        accumulate_grad_batches, gradient_clip_val, gradient_clip_algorithm, precision)
    if optimizer is None:
        optimizer = trainer.optimizers[0] if trainer is not None and trainer.optimizers else \
            module_optimizer(module)
    with detached(module):
        return _estimate(module, traced_batch(batch, settings, look_ahead),
                         optimizer=getattr(optimizer, "_optimizer", optimizer), device=device,
                         budget=budget, step=LightningStep(settings), **knobs)
