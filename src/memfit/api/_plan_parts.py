"""The parts of one ``plan_traced`` call that the planner's phases (``api._planner``) share:
its ``Context``, the memory and time models of a precision (from its plain trace and one at half
the batch), the ``Plan`` made from a search's ``Choice``, the optimizer implementations the
search may switch to, and the refusal from the parameters alone before any trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from memfit.api._choice import knob_values
from memfit.api._floor import first_samples, lower_bound
from memfit.api._plan_allocator import AllocatorChoice
from memfit.api._plan_words import counted_levers, excluded_levers, global_reasons, \
    host_bytes, too_small
from memfit.api._user_step import STEP_FIXED_NOTE
from memfit.api.estimate import estimate
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe, impl_of, supports_impl
from memfit.planner import Plan
from memfit.planner.build import block_costs, build_plan
from memfit.planner.memory_model import MemoryModel
from memfit.planner.choice import Choice
from memfit.planner.time_model import TimeModel
from memfit.units import format_bytes

__all__ = ["Context", "refuse_below_bound", "modelled_impl", "impl_variants",
           "precision_models", "user_models", "plain_s", "as_choice", "make_plan",
           "stages_ahead"]


def refuse_below_bound(model, spec, k: Knobs, recipe, trainable, budget_bytes: int,
                       numerics: bool, user_step: bool, precisions,
                       in_backward: bool = False, grads_to_host: bool = False,
                       bare: bool = False) -> None:
    """``BudgetTooSmall`` before any trace where the floor's lower bound from the parameters
    alone (_floor) is over the budget: the same words as the traced floor's. ``in_backward``:
    the optimizer may step in backward; ``grads_to_host``: the gradients may go to the host in
    backward (each fixed, or open to the search)."""
    bound = lower_bound(
        list(model.parameters()), precisions=sorted(precisions),
        optimizer_class=recipe.optimizer_class(trainable),
        context_bytes=spec.cuda_context_bytes if spec.kind == "cuda" else 0,
        state_on_host=k.offload_optimizer is not False,
        params_on_host=k.offload_params not in (None, "none") or (
            k.offload_params is None and k.offload_optimizer is not False and not user_step),
        state=k.optimizer_state, low_bit=numerics and not user_step, in_backward=in_backward,
        grads_to_host=grads_to_host)
    if bound.bytes <= budget_bytes:
        return
    raise too_small(bound.bytes, bound, f"a bound from the parameters alone at {bound.precision}, "
                    "checked before tracing", budget_bytes,
                    excluded_levers(k, numerics, user_step),
                    counted=counted_levers(k, numerics, user_step, sorted(precisions),
                                           in_backward=in_backward and
                                           not k.optimizer_in_backward),
                    bound=True, model=model, bare=bare,
                    context_bytes=spec.cuda_context_bytes if spec.kind == "cuda" else 0)


@dataclass
class Context:
    """What every plan of one ``plan_traced`` call shares."""

    knobs: Knobs
    spec: object
    budget_bytes: int
    baseline_s: float              # the plain step at the user's precision (ratios' base)
    b: int
    held: dict[str, int]           # the caller's batch held beside the step, per precision
    user: str                      # the user's precision
    default_impl: str | None       # the optimizer implementation as given (modelled)
    plain_bytes: int               # device bytes of the user's plain step
    impl_searched: bool            # other optimizer implementations were weighed
    user_step: bool = False        # planned for the user's own step (``step=fn``)
    floor_bytes: int | None = None     # the least re-traced, where the floor was traced
    fp32_state_bytes: float = 0.0      # the optimizer state as given, on the device
    alloc: AllocatorChoice | None = None   # the allocator setting's choice (_plan_allocator)


def modelled_impl(recipe: OptimizerRecipe, params, spec) -> str | None:
    """The implementation the optimizer as given runs on ``spec`` (optimizers)."""
    if recipe.impl is not None:
        return recipe.impl
    opt = recipe.instance if recipe.instance is not None else recipe.build(params, params)
    return impl_of(opt, cuda=spec.kind == "cuda")


def impl_variants(recipe: OptimizerRecipe, k: Knobs, optimizer_class: Callable[[], type],
                  default: str | None, fixed, spec) -> list[str]:
    """Implementations the planner may switch to (``api._planner``): none when the caller fixed
    one or passed an instance (it keeps its own), the optimizer state is on the host, or the
    target is a CPU (its default, the for-loop, already holds one parameter's temporaries at
    most). ``optimizer_class()``: the class the recipe builds."""
    if k.optimizer_impl is not None or recipe.instance is not None or default is None or \
            fixed.offload_optimizer or spec.kind != "cuda" or \
            k.optimizer_state not in (None, "fp32"):
        return []
    cls = optimizer_class()
    return [i for i in ("fused", "for-loop") if i != default and supports_impl(cls, i)]


def precision_models(model, batch, est, common, spec, precision: str, b: int, impl, say,
                     state=None):
    """The memory and time models of one precision, from its plain trace and a second one at
    half the batch (memory_model; the second needs no allocator replay)."""
    state = state or {}
    half = None
    if b > 1:
        say(f"tracing the plain step ({precision}, batch {b // 2})")
        half = estimate(model, first_samples(batch, b // 2), precision=precision,
                        allocator_replay=False, optimizer_impl=impl, **state, **common)
    memory = MemoryModel(est, b, half)
    if precision == "bf16-pure":        # its fp32 masters stay on the device (memory_model)
        memory = memory.limited(placements=(False,))
    elif state.get("offload_params") not in (None, "none"):
        memory = memory.limited(placements=(True,), excluded_modes=("offload",))
    return memory, TimeModel(est, spec, precision, b, memory, half)


def user_models(plain, spec, user: str, b: int):
    """Memory and time models of the user's own plain step (time_model): the base of every
    plan's step-time ratio."""
    memory = MemoryModel(plain, b)
    return memory, TimeModel(plain, spec, user, b, memory)


def plain_s(pair, b: int) -> float:
    """Seconds of a plain step (the whole batch, every block kept)."""
    memory, time = pair
    return time.step_s(b, b, ("keep",) * len(memory.blocks), False)


def as_choice(model_pair, key, b: int, est) -> Choice:
    memory, time = model_pair
    modes = ("keep",) * len(memory.blocks)
    return Choice(key[0], b, modes, False, est.peak_bytes, est.device_bytes,
                  time.step_s(b, b, modes, False), key[1])


def make_plan(ctx: Context, choice: Choice, est, model_pair, reasons: list[str]) -> Plan:
    memory, time = model_pair
    k, b, held = ctx.knobs, ctx.b, ctx.held[choice.precision]
    values = knob_values(choice, memory.blocks, k)
    knobs = k.replace(precision=choice.precision, **values)
    if ctx.user_step:              # the step fixes its precision and micro-batches
        knobs = knobs.replace(precision=None, micro_batch_size=None)
        reasons = [STEP_FIXED_NOTE] + reasons
    ratio = choice.step_s / ctx.baseline_s
    host = host_bytes(choice, est)
    why = reasons + global_reasons(k, choice, memory, b, ctx, ratio)
    if host:
        why.append(f"host RAM: the offload needs {format_bytes(host)} of host memory "
                   "(offloaded activations and optimizer state) free beside the job")
    plan = build_plan(knobs, memory.blocks, choice.modes, est, batch_size=b, ratio=ratio,
                      device=ctx.spec.name, budget_bytes=ctx.budget_bytes, reasons=why,
                      held_bytes=held, floor_bytes=ctx.floor_bytes,
                      costs=block_costs(memory, time, choice.modes, choice.micro_batch_size, b))
    return plan if ctx.alloc is None else ctx.alloc.apply(plan, est)


def stages_ahead(b: int, user: str, p: str, others: list[str], variants: int, levers) -> int:
    """The stages a plan expects where its plain step does not fit (``Stages.expect``): the
    plain traces and the searched precision ``p``'s half batch (``precision_models``), each of
    ``variants`` other implementations, each of ``others`` precisions (its plain trace unless
    it is the ``user``'s, and its half batch), the levers' traces, the search and the verify.
    An ETA's count: the verify loop's second attempt, DTR's batches and the last resorts add
    stages as they come."""
    half = int(b > 1)
    others_stages = sum(half + (q != user) for q in others)
    return 1 + (p != user) + half + variants + others_stages + \
        levers.traces_ahead([p, *others]) + 2
