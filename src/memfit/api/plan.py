"""``memfit.plan``: the fastest configuration predicted to fit a budget, verified by a re-trace.

Note 1 (the pipeline). Trace the user's plain step (their precision, the whole effective
batch as one micro-batch; ``Planned.plain``). Under "auto" on a GPU, trace the plain step at
the searched 16-bit precision too (Note 3). If the searched plain step fits and the caller
fixed nothing that changes it, take it. Else build the memory and time models from those
traces (planner.memory_model, planner.time_model), search (planner.search), and re-trace the
step with the choice applied.

Note 2 (verification). The re-trace is the answer: its peak and reserved bytes are the plan's
predictions. If it does not fit, the search runs again with the cap lowered by what was
missing (per precision, accumulated), up to ``_ATTEMPTS`` times; the model's errors cost speed,
never the budget. On CPU the re-trace is exact (track counts the same bytes); on a GPU it is the
CUDA model of ``estimate``.

Note 3 (precision "auto"). On a GPU, auto searches the 16-bit precision the card has (bf16, else
fp16 autocast): its matmuls run at least as fast as fp32 (time_model Note 2) and its activations
take half the bytes. The "plain step" is always the user's own: fp32 under auto, traced once;
the step-time ratio is against it (time_model Note 5), so a plan that changes the precision
says so, and a ratio below 1 is a speed-up. Where the user's plain step fits and is predicted
no slower (a small model, whose casts cost more launches than its matmuls save), auto keeps
it. On the CPU auto is fp32.

Note 4 (the caller's batch). The trace runs the batch as the step uses it: an all-ones
attention mask dropped, bf16-pure's float inputs cast. ``runner.step(batch)`` keeps the
caller's batch alive beside it, so those unused bytes are added to every prediction and check.

Note 5 (the floor). One number: the least device bytes of a configuration in the search
space, re-traced. The models propose the candidates (search Note 5: the least-memory modes
at micro-batch 1 and at the whole batch, and uniform recompute / offload beside them); each is
re-traced, and the least traced is the floor. It is what ``Plan.floor_bytes``, ``explain()``
and ``BudgetTooSmall.floor_bytes`` report, and a budget of exactly the floor plans (that
configuration), one byte less raises. How the candidates are traced: ``api._floor``. It is
traced when the search finds nothing that fits (the least-memory configuration is then the
answer, or ``BudgetTooSmall`` says by how much it misses), or when asked (``floor=True``); a
plan found without it has ``floor_bytes=None``: on a large model the floor's candidates cost
more traces than the plan itself (micro-batch 1 runs several micro-batches per trace).

Note 7 (the user's step). With ``step=fn`` every trace above runs the user's step
(``api._user_step`` Notes 1-4), the half-batch one on the first half of the batch. The step
fixes its precision, micro-batch size, clipping and zero_grad, so the search keeps the whole
batch in one micro-batch and the user's precision; it weighs only what reaches the step through
the model and the optimizer: per-block keep / recompute / selective / offload (block hooks) and
the optimizer state's placement. The batch is the step's as given (nothing held beside it,
Note 4). The plan's knobs leave ``precision`` and ``micro_batch_size`` unset (the step's own)
and its reasons say so.

Note 6 (the optimizer implementation). With ``optimizer_impl`` unset and the optimizer given
by name or factory, the planner may switch the implementation on a GPU target (optimizers
Note 1): each other one the class supports and that may need less than CUDA's default
foreach (fused, for-loop) is traced once, and the search weighs it like any other knob, before the optimizer
state leaves the device. An optimizer instance keeps its own unless ``optimizer_impl`` is set.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.api._choice import describe, knob_values
from memfit.api._floor import first_samples, least_memory
from memfit.api._plan_words import global_reasons, host_bytes, too_small
from memfit.api._setup import resolve_device, resolve_precision
from memfit.api._user_step import STEP_FIXED_NOTE, as_user_step, check_step_knobs
from memfit.api._validate import check_batch
from memfit.api.estimate import Estimate, estimate
from memfit.knobs import Knobs
from memfit.measure import storages_of
from memfit.optimizers import OptimizerRecipe, impl_of, supports_impl
from memfit.planner import Plan
from memfit.planner.memory_model import MemoryModel, optimizer_rise_bytes
from memfit.planner.search import Choice, Constraints, search
from memfit.planner.time_model import TimeModel
from memfit.step import prepare_batch
from memfit.techniques._blocks import resolve_policy
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.precision import Precision
from memfit.units import format_bytes, parse_bytes

__all__ = ["plan", "plan_traced", "Planned"]

_ATTEMPTS = 5
_SLACK_BYTES = 2 ** 20       # added to each verified shortfall, so a retry does not land on it


def plan(model: nn.Module, batch, budget=None, optimizer="adamw", device=None,
         loss_fn: Callable | None = None, **kwargs) -> Plan:
    """The fastest configuration of the step predicted to fit ``budget`` device bytes.

    ``budget``: bytes or "11GiB" (default: the device's usable memory). Knobs the caller sets
    are kept; the rest are searched: ``precision`` only under "auto", ``micro_batch_size``,
    per-block keep / recompute / selective / offload, ``offload_optimizer``. Other arguments as
    in ``memfit.estimate``; ``on_progress(message)`` hears each stage. Raises
    ``memfit.BudgetTooSmall`` (with the floor) when nothing in the search space fits.
    ``step=fn``: plan the user's own step ``fn(model, batch, optimizer)`` (traced as in
    ``memfit.estimate``, several times; Note 7): only per-block modes and the optimizer's
    placement are searched; ``scheduler``: a factory ``optimizer -> LR scheduler``.
    ``floor=True``: trace the floor (the least any configuration needs, ``Plan.floor_bytes``)
    even when a plan fits; else only when nothing does (Note 5).
    """
    return plan_traced(model, batch, budget, optimizer, device, loss_fn, **kwargs).plan


@dataclass
class Planned:
    """A plan with the traces behind it: the plain step (at the plan's precision, the whole
    batch in one micro-batch) and the step with the plan applied (its re-trace)."""

    plan: Plan
    plain: Estimate
    chosen: Estimate


def plan_traced(model: nn.Module, batch, budget=None, optimizer="adamw", device=None,
                loss_fn: Callable | None = None, *, count_fn: Callable | None = None,
                allocator=None, on_progress: Callable[[str], None] | None = None,
                step: Callable | None = None, scheduler: Callable | None = None,
                floor: bool = False, **knobs) -> Planned:
    """``plan``, with the plain and the chosen traces (for plots and reports)."""
    say = on_progress or (lambda message: None)
    k = Knobs.from_kwargs(**knobs)
    k.check_available()
    if k.remat:
        raise ValueError("remat=True: DTR keeps the budget at run time and the planner does not "
                         "weigh it against static plans yet; plan without remat, or use "
                         "memfit.fit(..., budget=..., remat=True) (or memfit.estimate(..., "
                         "remat=True, budget=...) to simulate it)")
    spec = resolve_device(model, device)
    budget_bytes = parse_bytes(budget) if budget is not None else spec.usable_bytes
    if budget_bytes > spec.usable_bytes and spec.kind == "cuda":
        warnings.warn(f"budget {format_bytes(budget_bytes)} is more than the "
                      f"{spec.display_name}'s usable {format_bytes(spec.usable_bytes)}: the plan "
                      "is for a card that large", stacklevel=3)
    user_step = as_user_step(step)
    original = batch
    if user_step is None:        # a user step takes the batch as given (Note 7)
        batch = prepare_batch(batch)
        check_batch(model, batch, loss_fn)
    b = batch_size_of(batch)
    if user_step is not None:
        k = check_step_knobs(k, b, loss_fn).replace(micro_batch_size=b)
    trainable = [t for t in model.parameters() if t.requires_grad]
    recipe = OptimizerRecipe(optimizer, impl=k.optimizer_impl)
    recipe.check_params(trainable)
    recipe.check_impl(trainable)
    p = resolve_precision(k.precision, spec)              # the one searched (Note 3)
    user = "fp32" if k.precision in (None, "auto") else p
    fixed = _constraints(model, k, b)
    common = dict(optimizer=optimizer, device=spec, loss_fn=loss_fn, count_fn=count_fn,
                  allocator=allocator, max_grad_norm=k.max_grad_norm, zero_grad=k.zero_grad,
                  step=user_step, scheduler=scheduler)
    say(f"tracing the plain step ({user}, batch {b})")
    plain = estimate(model, batch, precision=user, optimizer_impl=k.optimizer_impl, **common)
    base = plain
    if p != user:
        say(f"tracing the plain step ({p}, batch {b})")
        base = estimate(model, batch, precision=p, optimizer_impl=k.optimizer_impl, **common)
    key = (p, k.optimizer_impl)
    models = {key: _models(model, batch, base, common, spec, p, b, k.optimizer_impl, say)}
    default_impl = _modelled_impl(recipe, trainable, spec)
    variants = _impl_variants(recipe, k, trainable, default_impl, fixed, spec)
    for impl in variants:
        say(f"tracing the optimizer step with the {impl} implementation")
        other = estimate(model, batch, precision=p, optimizer_impl=impl, allocator_replay=False,
                         **common)
        memory, time = models[key]
        models[(p, impl)] = memory.with_optimizer_step(other), time.with_optimizer_step(other)
    user_pair = models[key] if p == user else _user_models(plain, spec, user, b)
    baseline_s = _plain_s(user_pair, b)
    held = {q: 0 if user_step else _held_bytes(original, q) for q in {p, user}}   # Note 4
    ctx = _Context(k, spec, budget_bytes, baseline_s, b, held, user, default_impl,
                   plain.device_bytes + held[user], bool(variants), user_step is not None)
    traced_floor = None

    def least():                   # the floor, traced once (Note 5)
        nonlocal traced_floor
        if traced_floor is None:
            traced_floor = least_memory(model, batch, models, fixed, k, common, held, b, say)
            ctx.floor_bytes = traced_floor[0]
        return traced_floor

    if floor:
        least()

    if fixed.keep_allowed(base.blocks) and not fixed.offload_optimizer and \
            fixed.micro_batch_size in (None, b):
        fits = [(pair, est, q) for pair, est, q in ((models[key], base, p), (user_pair, plain, user))
                if est.device_bytes + held[q] <= budget_bytes]
        if fits:       # the faster plain step that fits (Note 3: auto keeps fp32 where faster)
            pair, est, q = min(fits, key=lambda f: _plain_s(f[0], b))
            choice = _as_choice(pair, (q, k.optimizer_impl), b, est)
            why = ["the plain step fits: nothing to change"] if q == user else []
            if q == user and p != user:
                why.append(f"auto keeps {user}: the {p} step is predicted no faster here")
            return Planned(_make_plan(ctx, choice, est, pair, why), plain, est)

    margins: dict = {q: held[q[0]] for q in models}
    for attempt in range(_ATTEMPTS):
        say("searching" if attempt == 0 else f"searching again (attempt {attempt + 1})")
        choice = search(models, b, budget_bytes, fixed, margins)
        if choice is None:
            break
        say(f"verifying: re-tracing {describe(choice, b)}")
        q = choice.precision
        est = estimate(model, batch, precision=q,
                       **knob_values(choice, models[choice.key][0].blocks, k), **common)
        if est.device_bytes + held[q] <= budget_bytes:
            reasons = [] if attempt == 0 else [
                f"the first {attempt} choice(s) re-traced over the budget; the search ran again "
                f"{format_bytes(margins[choice.key] - held[q])} tighter"]
            return Planned(_make_plan(ctx, choice, est, models[choice.key], reasons), plain, est)
        short = est.device_bytes + held[q] - budget_bytes + _SLACK_BYTES
        margins[choice.key] = margins.get(choice.key, 0) + short
    _, floor_choice, floor_est = least()
    if ctx.floor_bytes <= budget_bytes:
        if floor_est is None or floor_est.reserved_bytes == floor_est.peak_bytes and \
                spec.kind == "cuda":        # extrapolated or not replayed: trace it whole
            say(f"re-tracing {describe(floor_choice, b)}")
            floor_est = estimate(model, batch, precision=floor_choice.precision,
                                 **knob_values(floor_choice,
                                                models[floor_choice.key][0].blocks, k),
                                 **common)
        return Planned(_make_plan(ctx, floor_choice, floor_est, models[floor_choice.key],
                                  ["only the least-memory configuration fits"]), plain, floor_est)
    raise too_small(ctx.floor_bytes, models[floor_choice.key][0], describe(floor_choice, b),
                    budget_bytes)


@dataclass
class _Context:
    """What every plan of one ``plan_traced`` call shares."""

    knobs: Knobs
    spec: object
    budget_bytes: int
    baseline_s: float              # the plain step at the user's precision (Note 3)
    b: int
    held: dict[str, int]           # per precision (Note 4)
    user: str                      # the user's precision
    default_impl: str | None       # the optimizer implementation as given (modelled)
    plain_bytes: int               # device bytes of the user's plain step
    impl_searched: bool            # other optimizer implementations were weighed (Note 6)
    user_step: bool = False        # planned for the user's own step (Note 7)
    floor_bytes: int | None = None     # the least re-traced, where traced (Note 5)


def _modelled_impl(recipe: OptimizerRecipe, params, spec) -> str | None:
    """The implementation the optimizer as given runs on ``spec`` (optimizers Note 1)."""
    if recipe.impl is not None:
        return recipe.impl
    opt = recipe.instance if recipe.instance is not None else recipe.build(params, params)
    return impl_of(opt, cuda=spec.kind == "cuda")


def _impl_variants(recipe: OptimizerRecipe, k: Knobs, params, default: str | None,
                   fixed, spec) -> list[str]:
    """Implementations the planner may switch to (Note 6): none when the caller fixed one or
    passed an instance (it keeps its own), the optimizer state is on the host, or the target
    is a CPU (its default, the for-loop, already holds one parameter's temporaries at most)."""
    if k.optimizer_impl is not None or recipe.instance is not None or default is None or \
            fixed.offload_optimizer or spec.kind != "cuda":
        return []
    cls = recipe.optimizer_class(params)
    return [i for i in ("fused", "for-loop") if i != default and supports_impl(cls, i)]


def _models(model, batch, est, common, spec, precision: str, b: int, impl, say):
    """The memory and time models of one precision, from its plain trace and a second one at
    half the batch (memory_model Note 2; the second needs no allocator replay)."""
    half = None
    if b > 1:
        say(f"tracing the plain step ({precision}, batch {b // 2})")
        half = estimate(model, first_samples(batch, b // 2), precision=precision,
                        allocator_replay=False, optimizer_impl=impl, **common)
    memory = MemoryModel(est, b, half)
    return memory, TimeModel(est, spec, precision, b, memory, half)


def _constraints(model: nn.Module, k: Knobs, b: int) -> Constraints:
    """What the caller fixed, knob by knob (search Note 3)."""
    modes = None
    if k.checkpoint is not None or k.offload is not None:
        per = resolve_policy(model, k.checkpoint or "none", "recompute", "Checkpoint")
        off = resolve_policy(model, k.offload or "none", "offload", "Offload")
        modes = {}
        for name in set(per) | set(off):
            rec = per.get(name, "keep") if k.checkpoint is not None else None
            moved = off.get(name) == "offload" if k.offload is not None else None
            if moved:                       # offloaded (recomputed too: the search mirrors it)
                modes[name] = ("offload",)
            elif rec not in (None, "keep"):
                modes[name] = (rec,)
            elif rec == "keep":             # not recomputed: kept, or offloaded if free
                modes[name] = ("keep",) if moved is False else ("keep", "offload")
            else:                           # recompute free, not offloaded
                modes[name] = ("keep", "recompute", "selective")
    m = k.micro_batch_size
    return Constraints(None if m is None else min(m, b), modes, k.offload_optimizer)


def _user_models(plain, spec, user: str, b: int):
    """Memory and time models of the user's own plain step (Note 3, time_model Note 5)."""
    memory = MemoryModel(plain, b)
    return memory, TimeModel(plain, spec, user, b, memory)


def _plain_s(pair, b: int) -> float:
    """Seconds of a plain step (the whole batch, every block kept)."""
    memory, time = pair
    return time.step_s(b, b, ("keep",) * len(memory.blocks), False)


def _as_choice(model_pair, key, b: int, est) -> Choice:
    memory, time = model_pair
    modes = ("keep",) * len(memory.blocks)
    return Choice(key[0], b, modes, False, est.peak_bytes, est.device_bytes,
                  time.step_s(b, b, modes, False), key[1])


def _held_bytes(batch, precision: str) -> int:
    """Bytes of the caller's batch the step does not use but ``runner.step(batch)`` keeps alive
    beside it (Note 4): an all-ones mask that is dropped, bf16-pure's fp32 originals."""
    used = Precision(Precision.Config(precision)).prepare_batch(prepare_batch(batch))
    kept = {st._cdata for t in tree_leaves(used) if isinstance(t, torch.Tensor)
            for st in storages_of(t)}
    seen, total = set(), 0
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            for st in storages_of(t):
                if st._cdata not in kept and st._cdata not in seen:
                    seen.add(st._cdata)
                    total += st.nbytes()
    return total


_PLAN_FIELDS = {f.name for f in dataclasses.fields(Plan)}


def _make_plan(ctx: _Context, choice: Choice, est, model_pair, reasons: list[str]) -> Plan:
    memory, time = model_pair
    k, b, held = ctx.knobs, ctx.b, ctx.held[choice.precision]
    values = knob_values(choice, memory.blocks, k)
    knobs = k.replace(precision=choice.precision, **values)
    if ctx.user_step:              # the step's own (Note 7)
        knobs = knobs.replace(precision=None, micro_batch_size=None)
        reasons = [STEP_FIXED_NOTE] + reasons
    m, n = choice.micro_batch_size, -(-b // choice.micro_batch_size)
    costs = [{"name": name, "mode": mode,
              "saved_bytes": int(memory.held_saved_bytes(i, mode, m)),
              "time_s": time.mode_s(i, mode, m, n, b)}
             for i, (name, mode) in enumerate(zip(memory.blocks, choice.modes))]
    device_bytes = est.device_bytes + held
    ratio = choice.step_s / ctx.baseline_s
    host = host_bytes(choice, est)
    why = reasons + global_reasons(k, choice, memory, b, ctx, ratio)
    extra = {}
    if "predicted_host_bytes" in _PLAN_FIELDS:
        extra["predicted_host_bytes"] = host
    elif host:
        why.append(f"host RAM: the offload needs {format_bytes(host)} of host memory "
                   "(offloaded activations and optimizer state) free beside the job")
    return Plan(knobs, blocks=dict(zip(memory.blocks, choice.modes)),
                predicted_peak_bytes=est.peak_bytes + held,
                predicted_reserved_bytes=est.reserved_bytes + held,
                predicted_device_bytes=device_bytes,
                predicted_step_time_ratio=ratio, device=ctx.spec.name,
                budget_bytes=ctx.budget_bytes,
                predicted_optimizer_step_bytes=optimizer_rise_bytes(est), batch_size=b,
                floor_bytes=None if ctx.floor_bytes is None else min(ctx.floor_bytes, device_bytes),
                block_costs=costs,
                reasons=why, **extra)
