"""Hugging Face Accelerate: estimate, plan and apply memfit to an ``accelerate`` training loop.

```python
from memfit.integrations import accelerate as mf_acc
model, optimizer = accelerator.prepare(model, optimizer)
est = mf_acc.estimate(accelerator, model, optimizer, batch)    # one steady-state optimizer step
changes = mf_acc.fit(accelerator, model, optimizer, batch, budget="11GiB")
for batch in dataloader:                                       # the loop as it always was
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
changes.remove()                                               # hooks off, optimizer back
```

``estimate`` traces the loop body exactly as Accelerate runs it (``_accelerate_step``: the loop, its
mixed precision, the accelerator's loop state, the batch) through ``memfit.estimate(step=fn)``;
``fit`` plans it with ``memfit.plan(step=fn)`` and applies the plan to the prepared model and
optimizer (``_apply``).
"""

from __future__ import annotations

try:
    import accelerate as _accelerate  # noqa: F401  (the dependency itself)
except ImportError as e:      # pragma: no cover - exercised only without accelerate
    raise ImportError("memfit.integrations.accelerate needs Hugging Face accelerate: "
                      "pip install memfit[hf]") from e

from collections.abc import Callable

from memfit.api.estimate import Estimate
from memfit.api.estimate import estimate as _estimate
from memfit.api.plan import plan as _plan
from memfit.integrations._apply import Changes, apply_plan
from memfit.integrations._accelerate_step import (AccelerateStep, check_supported,
                                                  inner_optimizer, step_state, traced_batch)
from memfit.units import parse_bytes

__all__ = ["estimate", "fit", "Changes"]


def estimate(accelerator, model, optimizer, batch, step: Callable | None = None, *,
             device=None, budget=None, max_grad_norm: float | None = None,
             scheduler: Callable | None = None, **knobs) -> Estimate:
    """Predict one steady-state optimizer step of an Accelerate loop (``_accelerate_step``).

    ``model`` and ``optimizer``: what ``accelerator.prepare`` returned (or not yet prepared);
    neither is touched. ``batch``: the DataLoader the loop iterates (its first batch used for
    each micro-batch; a prepared one's look-ahead batch counted), one batch as it yields it (a
    Mapping called as ``model(**batch)``, used for each of the ``gradient_accumulation_steps``
    micro-batches) or a list of that many (one per micro-batch). ``step``: the loop
    body ``fn(model, batch, optimizer)`` as written inside ``with
    accelerator.accumulate(model):`` (default: forward, ``accelerator.backward``,
    ``accelerator.clip_grad_norm_`` when ``max_grad_norm`` is given, ``optimizer.step()``,
    ``optimizer.zero_grad()``); it receives accelerate's optimizer wrapper over a fake copy,
    and what it returns is kept until its next call returns (the loop's ``loss``). The
    accumulation and mixed precision are the Accelerator's. ``scheduler``: a factory
    ``optimizer -> LR scheduler``. ``knobs``: what memfit adds through the model and the optimizer
    (``checkpoint``, ``offload``, ``offload_optimizer``, ``optimizer_impl``).
    """
    check_supported(accelerator)
    fn = AccelerateStep(accelerator, step, max_grad_norm)
    with step_state(accelerator):
        return _estimate(model, traced_batch(accelerator, batch),
                         optimizer=inner_optimizer(optimizer), device=device, budget=budget,
                         step=fn, scheduler=scheduler, **knobs)


def fit(accelerator, model, optimizer, batch, budget, step: Callable | None = None, *,
        device=None, max_grad_norm: float | None = None, verbose: bool = True,
        **knobs) -> Changes:
    """Plan the loop under ``budget`` device bytes and apply the plan (``_apply``).

    Arguments as in ``estimate``; ``model`` and ``optimizer`` must be the prepared ones the
    loop uses. The plan (``memfit.plan(step=fn)``) weighs per-block keep / recompute /
    selective / offload and the optimizer state's placement; block hooks go on ``model`` and an
    offloaded optimizer goes inside accelerate's wrapper, so the loop runs unchanged. An LR
    scheduler prepared over the optimizer rules optimizer offload out (it would drive the
    replaced one). ``knobs`` fix choices (e.g. ``offload_optimizer=False``). Returns the
    ``Changes`` (printed unless ``verbose=False``); ``changes.remove()`` undoes them. Raises
    ``memfit.BudgetTooSmall`` with the floor when nothing fits."""
    check_supported(accelerator)
    from accelerate.optimizer import AcceleratedOptimizer
    if not isinstance(optimizer, AcceleratedOptimizer):
        raise ValueError(f"fit: give the optimizer accelerator.prepare returned, got "
                         f"{type(optimizer).__name__} (fit swaps what runs inside accelerate's "
                         "wrapper, so the loop keeps its optimizer object)")
    inner = optimizer.optimizer
    scheduled = any(getattr(s.scheduler, "optimizer", None) in (optimizer, inner)
                    for s in accelerator._schedulers)
    if scheduled:
        if knobs.get("offload_optimizer"):
            raise ValueError("offload_optimizer=True: an LR scheduler was prepared over this "
                             "optimizer and would drive the replaced one; leave it unset")
        knobs["offload_optimizer"] = False
    fn = AccelerateStep(accelerator, step, max_grad_norm)
    budget_bytes = parse_bytes(budget)
    with step_state(accelerator):
        p = _plan(model, traced_batch(accelerator, batch), budget_bytes, optimizer=inner,
                  device=device, step=fn, **knobs)
    changes = apply_plan(p, model, inner, budget_bytes, swap=lambda new: _swap(optimizer, new))
    if scheduled:
        changes.notes.append("optimizer offload not considered: an LR scheduler was prepared "
                             "over the optimizer")
    if verbose:
        print(changes)
    return changes


def _swap(wrapper, new) -> Callable[[], None]:
    """``new`` runs inside accelerate's optimizer wrapper; returns the undo."""
    old, wrapper.optimizer = wrapper.optimizer, new
    return lambda: setattr(wrapper, "optimizer", old)
