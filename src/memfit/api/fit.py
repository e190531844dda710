"""``memfit.fit``: wrap the user's model and optimizer in a Runner that fits the budget."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from memfit.api._setup import build_runner, resolve_device, resolve_precision
from memfit.api._validate import check_batch
from memfit.api.estimate import estimate
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.runtime import Runner
from memfit.step import prepare_batch
from memfit.techniques.accumulation import Accumulation, batch_size_of
from memfit.units import format_bytes, parse_bytes

__all__ = ["fit"]


def fit(model: nn.Module, optimizer, batch, budget=None, device=None,
        loss_fn: Callable | None = None, *, count_fn: Callable | None = None, scheduler=None,
        **knobs) -> Runner:
    """A ``Runner`` that trains ``model`` one effective batch per ``runner.step(batch)``.

    ``optimizer``: an instance over the model's parameters (rebuilt only when a knob needs
    new parameters, e.g. bf16-pure master weights; ``runner.plan`` says so), or a factory
    ``params -> Optimizer``. ``batch``: an example effective batch (Mapping -> ``model(**batch)``
    and ``.loss``; else pass ``loss_fn(model, batch)``). ``budget``: device bytes ("11GiB");
    without ``micro_batch_size``, fit picks the largest micro-batch whose estimate fits.
    ``count_fn(batch)``: what the loss averages over (default: what the model's loss counts).
    ``scheduler``: an LR scheduler (or a factory ``optimizer -> scheduler``, needed with
    bf16-pure and offload_optimizer, which rebuild the optimizer) stepped once per effective
    batch. Knobs (``memfit.Knobs``): ``precision``, ``micro_batch_size``, ``max_grad_norm``,
    ``checkpoint``, ``offload``, ``offload_optimizer``, ``remat`` (DTR around each step: under
    ``budget`` if given, else on out-of-memory). Everything is checked before the model is touched.
    """
    k = Knobs.from_kwargs(**knobs)
    k.check_available()
    spec = resolve_device(model, device)
    k = k.replace(precision=resolve_precision(k.precision, spec))
    if (k.precision == "bf16-pure" or k.offload_optimizer) and hasattr(scheduler, "step"):
        raise ValueError(
            "bf16-pure and offload_optimizer rebuild the optimizer, so a scheduler built on the "
            "one passed in would drive nothing: pass scheduler=a factory, e.g. "
            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)")
    recipe = OptimizerRecipe(optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    recipe.check_params(trainable)
    example = prepare_batch(batch)
    check_batch(model, example, loss_fn)
    b = batch_size_of(example)
    plan = Plan(k, device=spec.name)
    if budget is not None:
        k, plan = _fit_budget(model, optimizer, example, spec, loss_fn, count_fn, k,
                              parse_bytes(budget), b)
    Accumulation(Accumulation.Config(k.micro_batch_size)).warn_if_inexact(model, example)
    if k.precision == "bf16-pure":
        plan.optimizer_rebuilt = True
        plan.reasons.append("bf16-pure: the optimizer was rebuilt over fp32 master weights "
                            "(runner.optimizer); the one passed in is no longer used")
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    return build_runner(model, recipe, k, plan=plan, loss_fn=loss_fn, count_fn=count_fn,
                        scheduler=scheduler, device_type=device_type)


def _fit_budget(model, optimizer, batch, spec, loss_fn, count_fn, k: Knobs, budget: int, b: int):
    """The largest micro-batch size whose estimate fits ``budget`` (peak is monotone in it)."""
    def predict(m: int):
        return estimate(model, batch, optimizer, spec, loss_fn, count_fn=count_fn,
                        budget=budget, **k.replace(micro_batch_size=m).to_dict())

    if k.micro_batch_size is not None:
        candidates = [k.micro_batch_size]
    else:
        candidates = list(range(1, b + 1))
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:                      # binary search for the last size that fits
        mid = (lo + hi) // 2
        est = predict(candidates[mid])
        if est.fits:
            best, lo = (candidates[mid], est), mid + 1
        else:
            hi = mid - 1
    if best is None:
        floor = predict(candidates[0])
        raise BudgetTooSmall(
            f"no micro-batch size fits {format_bytes(budget)}: even micro-batch "
            f"{candidates[0]} needs {format_bytes(floor.device_bytes)}. Levers that would "
            "still help: a lower precision, shorter sequences, checkpoint/offload knobs, "
            "an 8-bit optimizer, or sharding over more GPUs",
            floor_bytes=floor.device_bytes, budget_bytes=budget)
    m, est = best
    k = k.replace(micro_batch_size=m)
    plan = Plan(k, predicted_peak_bytes=est.peak_bytes, predicted_reserved_bytes=est.reserved_bytes,
                device=spec.name, budget_bytes=budget)
    plan.reasons.append(
        f"micro_batch_size {m} of {b}: the largest whose predicted peak "
        f"({format_bytes(est.peak_bytes)}) fits the budget ({format_bytes(budget)})")
    return k, plan
