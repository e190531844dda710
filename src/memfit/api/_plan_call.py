"""The job of one ``plan_traced`` call (``api.plan``), checked once, before any trace:
knobs, device, budget, batch, optimizer, the precisions weighed, and the bound that refuses a
budget below it without tracing. ``api._planner`` plans it (its notes say why each check is
made where it is).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch import nn

from memfit.api._plan_levers import (grads_offload_open, in_backward_open, numerics_allowed,
                                     state_knobs)
from memfit.api._plan_parts import refuse_below_bound
from memfit.api._plan_remat import check_remat, held_bytes
from memfit.api._setup import resolve_device, resolve_precision
from memfit.api._stages import Stages
from memfit.api._user_step import as_user_step, check_step_knobs
from memfit.api._validate import check_batch, check_micro_batch
from memfit.api.estimate import estimate
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe
from memfit.planner.choice import Constraints
from memfit.planner.variants import IN_BACKWARD_PRECISIONS, auto_precisions
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.quantized_base import QuantizedBase
from memfit.units import bare_count, format_bytes, parse_bytes

__all__ = ["PlanCall"]


@dataclass
class PlanCall:
    """One ``plan_traced`` call's job, checked once, before any trace."""

    model: nn.Module
    batch: object                  # as the step uses it (prepare_batch); a user step's as given
    original: object               # as the caller gave it
    b: int
    k: Knobs
    spec: object
    budget_bytes: int
    user_step: object | None
    recipe: OptimizerRecipe
    trainable: list
    p: str                         # the precision searched (auto: the card's 16-bit)
    user: str                      # the user's own
    others: list[str]              # the other precisions "auto" weighs (variants)
    numerics: bool                 # levers that change the numerics weighed
    fixed: Constraints
    common: dict                   # estimate's keywords every trace shares
    state: dict                    # a fixed optimizer_state / offload_params, in every trace
    say: Stages                    # on_progress, each stage numbered (an ETA's count)
    bare_budget: bool = False      # given as an int of bytes (the refusal's unit hint)

    @classmethod
    def checked(cls, model, batch, budget, optimizer, device, loss_fn, count_fn, allocator,
                on_progress, step, scheduler, floor, allow_numerics_change,
                knobs) -> "PlanCall":
        k = Knobs.from_kwargs(**knobs)
        numerics = numerics_allowed(allow_numerics_change, k)
        k.check_available()
        check_remat(k, step)
        spec = resolve_device(model, device)
        budget_bytes = parse_bytes(budget) if budget is not None else spec.usable_bytes
        if budget_bytes > spec.usable_bytes and spec.kind == "cuda":
            warnings.warn(f"budget {format_bytes(budget_bytes)} is more than the "
                          f"{spec.display_name}'s usable {format_bytes(spec.usable_bytes)}: the "
                          "plan is for a card that large", stacklevel=4)
        user_step = as_user_step(step)
        original = batch
        if user_step is None:        # a user step takes the batch as given
            batch = prepare_batch(batch)
            check_batch(model, batch, loss_fn)
        b = batch_size_of(batch)
        check_micro_batch(k.micro_batch_size, b)
        if user_step is not None:
            k = check_step_knobs(k, b, loss_fn).replace(micro_batch_size=b)
        trainable = [t for t in model.parameters() if t.requires_grad]
        recipe = OptimizerRecipe(optimizer, impl=k.optimizer_impl)
        recipe.check_params(trainable)
        recipe.check_impl(trainable)
        p = resolve_precision(k.precision, spec)
        user = "fp32" if k.precision in (None, "auto") else p
        others = [q for q in auto_precisions(spec) if q != p] \
            if k.precision == "auto" and user_step is None else []
        if k.optimizer_in_backward and k.precision == "auto":   # no fp16 scaler, no masters
            p = p if p in IN_BACKWARD_PRECISIONS else "fp32"
            others = [q for q in others if q in IN_BACKWARD_PRECISIONS and q != p]
        if not floor and not k.remat:     # refused below the bound before any trace
            bounded = model if k.quantize_base in (None, "none") else QuantizedBase(
                QuantizedBase.Config(kind=k.quantize_base)).twin(model)[0]   # its weights
            refuse_below_bound(bounded, spec, k, recipe, trainable, budget_bytes, numerics,
                               user_step is not None, {p, user, *others},
                               bool(k.optimizer_in_backward) or
                               in_backward_open(k, user_step is not None, b),
                               bool(k.offload_gradients) or
                               grads_offload_open(k, user_step is not None),
                               bare=bare_count(budget))
        common = dict(optimizer=optimizer, device=spec, loss_fn=loss_fn, count_fn=count_fn,
                      allocator=allocator, max_grad_norm=k.max_grad_norm,
                      zero_grad=k.zero_grad, step=user_step, scheduler=scheduler)
        if k.quantize_base is not None:         # in every trace
            common["quantize_base"] = k.quantize_base
        return cls(model, batch, original, b, k, spec, budget_bytes, user_step, recipe,
                   trainable, p, user, others, numerics, Constraints.of(model, k, b), common,
                   state_knobs(k), Stages(on_progress), bare_count(budget))

    def trace(self, precision: str, **knobs):
        """The step at ``precision`` with ``knobs`` (the fixed state's unless given)."""
        return estimate(self.model, self.batch, precision=precision,
                        **{**self.state, **knobs}, **self.common)

    def held(self, precision: str) -> int:
        """Bytes of the caller's batch held beside the step (``runner.step`` keeps it)."""
        return 0 if self.user_step else held_bytes(self.original, precision)
