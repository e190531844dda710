"""``memfit.plan``: the fastest configuration predicted to fit a budget, verified by a re-trace.

Note 1 (the pipeline). Trace the user's plain step (their precision, the whole effective
batch as one micro-batch; ``Planned.plain``). Under "auto" on a GPU, trace the plain step at
the searched 16-bit precision too (Note 3). If the searched plain step fits and the caller
fixed nothing that changes it, take it. Else build the memory and time models from those
traces (planner.memory_model, planner.time_model), search (planner.search), and re-trace the
step with the choice applied.

Note 2 (verification). The re-trace is the answer: its peak and reserved bytes are the plan's
predictions. If it does not fit, the search runs again with the cap lowered by what was
missing (per precision, accumulated): the one verify loop every planner runs
(``planner.verify``); the model's errors cost speed, never the budget. On CPU the re-trace is
exact (track counts the same bytes); on a GPU it is the CUDA model of ``estimate``.

Note 3 (precision "auto"). On a GPU, auto searches the 16-bit precision the card has (bf16, else
fp16 autocast): its matmuls run at least as fast as fp32 (time_model) and its activations
take half the bytes. The "plain step" is always the user's own: fp32 under auto, traced once;
the step-time ratio is against it (time_model), so a plan that changes the precision
says so, and a ratio below 1 is a speed-up. Where the user's plain step fits and is predicted
no slower (a small model, whose casts cost more launches than its matmuls save), auto keeps
it. On the CPU auto is fp32.

Note 4 (the caller's batch). The trace runs the batch as the step uses it: an all-ones
attention mask dropped, bf16-pure's float inputs cast. ``runner.step(batch)`` keeps the
caller's batch alive beside it, so those unused bytes are added to every prediction and check.

Note 5 (the floor). One number: the least device bytes of a configuration in the search
space, re-traced. The models propose the candidates (search: the least-memory modes
at micro-batch 1 and at the whole batch, and uniform recompute / offload beside them); each is
re-traced, and the least traced is the floor. It is what ``Plan.floor_bytes``, ``explain()``
and ``BudgetTooSmall.floor_bytes`` report, and a budget of exactly the floor plans (that
configuration), one byte less raises. How the candidates are traced: ``api._floor``. It is
traced when the search finds nothing that fits (the least-memory configuration is then the
answer, or ``BudgetTooSmall`` says by how much it misses), or when asked (``floor=True``); a
plan found without it has ``floor_bytes=None``: on a large model the floor's candidates cost
more traces than the plan itself (micro-batch 1 runs several micro-batches per trace).
Before any trace, the floor's lower bound from the parameters alone (weights, gradients,
optimizer state at the least the search may pick; _floor) refuses a budget under it in
well under a second, with the same words (``BudgetTooSmall.floor_is_bound``). Not with
``floor=True`` (the caller asks for the traced floor, even where nothing fits) nor with
``remat=True`` (DTR's floor is its simulation's, Note 9).

Note 6 (the optimizer implementation). With ``optimizer_impl`` unset and the optimizer given
by name or factory, the planner may switch the implementation on a GPU target
(``memfit.optimizers``): each other one the class supports and that may need less than CUDA's
default foreach (fused, for-loop) is traced once (its optimizer step alone:
``estimate(optimizer_only=True)``), and the search weighs it like any other knob,
before the optimizer state leaves the device. An optimizer instance keeps its own unless
``optimizer_impl`` is set.

Note 7 (the user's step). With ``step=fn`` every trace above runs the user's step
(``api._user_step``), the half-batch one on the first half of the batch. The step
fixes its precision, micro-batch size, clipping and zero_grad, so the search keeps the whole
batch in one micro-batch and the user's precision; it weighs only what reaches the step through
the model and the optimizer: per-block keep / recompute / selective / offload (block hooks) and
the optimizer state's placement. The batch is the step's as given (nothing held beside it,
Note 4). The plan's knobs leave ``precision`` and ``micro_batch_size`` unset (the step's own)
and its reasons say so.

Note 8 (every lever, issue 15). Once the plain step does not fit, "auto" also traces the other
precisions it weighs (planner.variants: fp32 where 16-bit gains nothing, bf16-pure where
bf16 is supported); where numerics may change (``allow_numerics_change=True``, implied by
precision "auto") each low-bit optimizer state gets a model; when nothing fits, the gradients
moved to the host in backward (``offload_gradients``) get one and the search runs again, then,
if still nothing fits, the block weights on the host (parameter offload) (variants).
The floor counts them all; ``BudgetTooSmall`` names what is beyond them (_plan_words).
A caller's fixed ``optimizer_state`` / ``offload_params`` / ``offload_gradients`` is in every
trace.

Note 9 (DTR). ``remat=True`` plans DTR alone on the whole batch (planner.remat_choice;
with ``BudgetTooSmall`` at DTR's floor). With ``remat`` unset, a static plan that was found is
weighed against DTR over ``batches`` (representative batches of the job, the planned one the
largest) and DTR taken where it is predicted faster (remat_choice). Where every batch
has the same shapes (or none are given) DTR is not weighed: on one batch the static search
already spans what DTR does (whole-block recomputes, remat_choice), so a DTR advantage
there would be the two models' disagreement, not a gain. ``remat=False`` never weighs it.

Note 10 (QLoRA). Where numerics may change and the model has frozen float linear layers (a LoRA
or frozen-base job), holding them in NF4 (``quantize_base="nf4"``: QLoRA's bitsandbytes layout,
double quantization, bf16 compute) is the last lever: when no plan fits the float base, the
whole plan is made again with it fixed. Every trace then quantizes a meta twin of the model
(docs/techniques/quantized-base.md), the bound before tracing counts the twin's weights, and
the plan says so first among its reasons. A run of the plan quantizes the model in place. Only
NF4 is weighed (the usual choice, and the smallest with FP4); a caller's own
``quantize_base`` is kept.

Note 11 (a compiled model). Per-block modes are not applied inside a compiled region
(trace.compiled), so a compiled model's plan searches precision, micro-batches and the
optimizer's levers; torch.compile's own lever, ``activation_memory_budget`` (the share of the
activations the min-cut partitioner keeps), is planned as a whole: the plan is made again with
it fixed at each of ``_plan_levers.COMPILE_BUDGETS`` (0.5, 0.0), each trace then compiling
the regions under it. When nothing fits at torch's default, the first that fits is the answer;
when a plan fits by slowing the step (anything but the plain step), each budget's plan is
weighed against it by predicted step time (``Planned.step_s``, absolute seconds: each plan's
ratio is to the plain step under its own budget) and the fastest is the answer. Either way the
plan's first reason says so. Notes 10 and 11 are one loop: ``_plan_levers.last_levers`` lists
the levers to plan again with, in turn, and which are weighed.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from memfit.api._choice import describe, knob_values
from memfit.api._compare_gpus import fewest_gpus
from memfit.api._floor import first_samples, least_memory, longest_sequence, lower_bound
from memfit.api._plan_allocator import AllocatorChoice
from memfit.api._plan_levers import (Levers, grads_offload_open, in_backward_open,
                                     last_levers, numerics_allowed, state_knobs)
from memfit.api._plan_remat import Planned, RematWeigh, check_remat, held_bytes, weigh
from memfit.api._plan_sharded import is_sharded, plan_sharded
from memfit.api._plan_words import (counted_levers, excluded_levers, global_reasons,
                                    host_bytes, too_small)
from memfit.api._setup import resolve_device, resolve_precision
from memfit.api._stages import Stages
from memfit.api._user_step import STEP_FIXED_NOTE, as_user_step, check_step_knobs
from memfit.api._validate import check_batch, check_order
from memfit.api.estimate import estimate
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe, impl_of, supports_impl
from memfit.planner import Plan
from memfit.planner.memory_model import MemoryModel
from memfit.planner.search import Choice, Constraints, search
from memfit.planner.build import block_costs, build_plan
from memfit.planner.time_model import TimeModel
from memfit.planner.verify import Margins, verify_loop
from memfit.planner.variants import IN_BACKWARD_PRECISIONS, auto_precisions
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.quantized_base import QuantizedBase
from memfit.units import format_bytes, parse_bytes

__all__ = ["plan", "plan_traced", "Planned"]


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
    ``allow_numerics_change``: weigh low-bit optimizer states (default: only under
    precision "auto"; Note 8). ``batches``: representative batches of the job, against which
    DTR is weighed (``remat`` unset; ``remat=True`` plans DTR; Note 9).
    ``gpus=N`` or ``"auto"``, ``sharding``: several GPUs (``api._plan_sharded``).
    ``allocator``: a fixed ``AllocatorConfig`` (traced as set); unset, on a GPU the allocator
    setting that reserves least is chosen and counted (``Plan.allocator``, api._plan_allocator).
    """
    check_order("plan", budget=budget)
    if is_sharded(kwargs):
        return plan_sharded(model, batch, budget, optimizer, device, loss_fn, plan_one=plan,
                            **kwargs)
    return plan_traced(model, batch, budget, optimizer, device, loss_fn, **kwargs).plan


def plan_traced(model: nn.Module, batch, budget=None, optimizer="adamw", device=None,
                loss_fn: Callable | None = None, *, count_fn: Callable | None = None,
                allocator=None, on_progress: Callable[[str], None] | None = None,
                step: Callable | None = None, scheduler: Callable | None = None,
                floor: bool = False, allow_numerics_change: bool | None = None,
                batches=None, on_floor: Callable[[dict], None] | None = None,
                suggest_shorter: bool = True, **knobs) -> Planned:
    """``plan``, with the plain and the chosen traces (for plots and reports).
    ``on_floor(knobs)`` hears the floor's configuration (its knob values, the precision among
    them) when the floor is traced; ``suggest_shorter=False`` leaves out the refusal's longest
    sequence the floor holds (``api.levers`` asks that question itself)."""
    if is_sharded(knobs):
        raise ValueError("gpus/sharding: use memfit.plan (plan_traced plans one device)")
    planned, plain = None, False
    try:
        job = _PlanCall.checked(model, batch, budget, optimizer, device, loss_fn, count_fn,
                                allocator, on_progress, step, scheduler, floor,
                                allow_numerics_change, knobs)
        planner = _Planner(job, batches, on_floor, suggest_shorter)
        if planner.remat is not None and job.k.remat:   # DTR fixed by the caller
            return planner.remat.fixed(planner.plain)
        if floor:
            planner.least(stages_after=2)
        planned = planner.plain_fits()
        plain = planned is not None
        planned = planned or planner.searched() or planner.floor_plan()
    except BudgetTooSmall as e:
        refused = e
    levers = last_levers(model, Knobs.from_kwargs(**knobs), allow_numerics_change)
    if planned is not None:              # Note 11: weighed against a plan that slows the step
        levers = [lever for lever in levers if lever.weighed and not plain]
        if not levers or planned.step_s is None:
            return planned
    elif not levers:                     # Notes 10 and 11
        raise refused
    for lever in levers:
        if on_progress is not None:
            on_progress(lever.progress if planned is None else lever.progress_weighed)
        try:
            other = plan_traced(model, batch, budget, optimizer, device, loss_fn,
                                count_fn=count_fn, allocator=allocator,
                                on_progress=on_progress, step=step, scheduler=scheduler,
                                floor=floor, allow_numerics_change=allow_numerics_change,
                                batches=batches, on_floor=on_floor,
                                suggest_shorter=suggest_shorter,
                                **{**knobs, lever.knob: lever.value})
        except BudgetTooSmall as e:
            refused = e
            continue
        if planned is None:              # nothing fitted: the first that fits is the answer
            return _first_reason(other, lever.why)
        if other.step_s is not None and other.step_s < planned.step_s:
            planned = _first_reason(other, lever.faster.format(
                other=f"{other.step_s * 1e3:.3g} ms a step against {planned.step_s * 1e3:.3g}"
                      f" ms"))
    if planned is None:
        raise refused
    return planned


def _first_reason(planned: Planned, why: str) -> Planned:
    return dataclasses.replace(planned, plan=dataclasses.replace(
        planned.plan, reasons=(why, *planned.plan.reasons)))


@dataclass
class _PlanCall:
    """One ``plan_traced`` call's job, checked once, before any trace."""

    model: nn.Module
    batch: object                  # as the step uses it (Note 4); a user step's as given
    original: object               # as the caller gave it
    b: int
    k: Knobs
    spec: object
    budget_bytes: int
    user_step: object | None
    recipe: OptimizerRecipe
    trainable: list
    p: str                         # the precision searched (Note 3)
    user: str                      # the user's own
    others: list[str]              # the other precisions "auto" weighs (Note 8)
    numerics: bool                 # low-bit optimizer states weighed (Note 8)
    fixed: Constraints
    common: dict                   # estimate's keywords every trace shares
    state: dict                    # a fixed optimizer_state / offload_params, in every trace
    say: Stages                    # on_progress, each stage numbered (an ETA's count)

    @classmethod
    def checked(cls, model, batch, budget, optimizer, device, loss_fn, count_fn, allocator,
                on_progress, step, scheduler, floor, allow_numerics_change,
                knobs) -> "_PlanCall":
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
        p = resolve_precision(k.precision, spec)
        user = "fp32" if k.precision in (None, "auto") else p
        others = [q for q in auto_precisions(spec) if q != p] \
            if k.precision == "auto" and user_step is None else []
        if k.optimizer_in_backward and k.precision == "auto":   # no fp16 scaler, no masters
            p = p if p in IN_BACKWARD_PRECISIONS else "fp32"
            others = [q for q in others if q in IN_BACKWARD_PRECISIONS and q != p]
        if not floor and not k.remat:     # Note 5: no trace (asked for the floor: traced)
            bounded = model if k.quantize_base in (None, "none") else QuantizedBase(
                QuantizedBase.Config(kind=k.quantize_base)).twin(model)[0]     # Note 10
            _refuse_below_bound(bounded, spec, k, recipe, trainable, budget_bytes, numerics,
                                user_step is not None, {p, user, *others},
                                bool(k.optimizer_in_backward) or
                                in_backward_open(k, user_step is not None, b),
                                bool(k.offload_gradients) or
                                grads_offload_open(k, user_step is not None))
        common = dict(optimizer=optimizer, device=spec, loss_fn=loss_fn, count_fn=count_fn,
                      allocator=allocator, max_grad_norm=k.max_grad_norm,
                      zero_grad=k.zero_grad, step=user_step, scheduler=scheduler)
        if k.quantize_base is not None:         # in every trace (Note 10)
            common["quantize_base"] = k.quantize_base
        return cls(model, batch, original, b, k, spec, budget_bytes, user_step, recipe,
                   trainable, p, user, others, numerics, Constraints.of(model, k, b), common,
                   state_knobs(k), Stages(on_progress))

    def trace(self, precision: str, **knobs):
        """The step at ``precision`` with ``knobs`` (the fixed state's unless given)."""
        return estimate(self.model, self.batch, precision=precision,
                        **{**self.state, **knobs}, **self.common)

    def held(self, precision: str) -> int:
        """Bytes of the caller's batch held beside the step (Note 4)."""
        return 0 if self.user_step else held_bytes(self.original, precision)


class _Planner:
    """The search of one ``plan_traced`` call, phase by phase (Notes 1-9)."""

    def __init__(self, job: _PlanCall, batches, on_floor, suggest_shorter: bool):
        self.job, self.on_floor, self.suggest_shorter = job, on_floor, suggest_shorter
        k, p, user, b, say = job.k, job.p, job.user, job.b, job.say
        default_impl = _modelled_impl(job.recipe, job.trainable, job.spec)
        variants = _impl_variants(job.recipe, k, job.trainable, default_impl, job.fixed,
                                  job.spec)
        self.models, traces = {}, {}
        self.levers = Levers(job.model, job.batch, self.models, traces, job.common, job.spec,
                             b, k, job.numerics, job.user_step is not None, say)
        say.expect(_stages_ahead(job, len(variants), self.levers))
        say(f"tracing the plain step ({user}, batch {b})")
        self.plain = job.trace(user, optimizer_impl=k.optimizer_impl)
        self.base = self.plain
        if p != user:
            say(f"tracing the plain step ({p}, batch {b})")
            self.base = job.trace(p, optimizer_impl=k.optimizer_impl)
        traces[p] = self.base
        self.key = (p, k.optimizer_impl)
        self.models[self.key] = _models(job.model, job.batch, self.base, job.common, job.spec,
                                        p, b, k.optimizer_impl, say, job.state)
        for impl in variants:                                   # Note 6
            say(f"tracing the optimizer step with the {impl} implementation")
            other = job.trace(p, optimizer_impl=impl, optimizer_only=True)
            memory, time = self.models[self.key]
            self.models[(p, impl)] = (memory.with_optimizer_step(other),
                                      time.with_optimizer_step(other))
        self.user_pair = self.models[self.key] if p == user else \
            _user_models(self.plain, job.spec, user, b)
        self.held = {q: job.held(q) for q in {p, user}}
        self.ctx = _Context(k, job.spec, job.budget_bytes, _plain_s(self.user_pair, b), b,
                            self.held, user, default_impl,
                            self.plain.device_bytes + self.held[user], bool(variants),
                            job.user_step is not None)
        self.ctx.fp32_state_bytes = self.models[self.key][0].optimizer_state_bytes
        self.ctx.alloc = AllocatorChoice(job.model, job.spec, job.common["allocator"])
        self.remat = None
        if k.remat is not False and job.user_step is None:   # DTR weighed (Note 9)
            self.remat = RematWeigh(job.model, job.batch, batches, self.plain, job.common,
                                    job.spec, user, b, job.budget_bytes, job.state, k, say)
        self.margins = Margins(job.budget_bytes)          # the verify loop's (planner.verify)
        self.traced_floor = None

    def add_precisions(self) -> None:
        """The other precisions "auto" weighs (Note 8), traced once each."""
        job = self.job
        for q in job.others:
            if (q, job.k.optimizer_impl) in self.models:
                continue
            est = self.plain if q == job.user else None
            if est is None:
                job.say(f"tracing the plain step ({q}, batch {job.b})")
                est = job.trace(q, optimizer_impl=job.k.optimizer_impl)
            self.models[(q, job.k.optimizer_impl)] = _models(
                job.model, job.batch, est, job.common, job.spec, q, job.b, job.k.optimizer_impl,
                job.say, job.state)
            self.held[q] = job.held(q)
            self.levers.traces[q] = est

    def least(self, stages_after: int = 0):
        """The floor, traced once (Note 5), over every lever: ``(bytes, choice, trace)``.
        ``stages_after``: the stages that follow it (the search and the verify), for the
        ETA's count."""
        if self.traced_floor is None:
            job = self.job
            self.add_precisions()
            self.levers.add_low_bit()
            self.levers.add_chunked_loss()
            self.levers.add_optimizer_in_backward()
            self.levers.add_gradient_offload()
            self.levers.add_param_offload()
            self.traced_floor = least_memory(job.model, job.batch, self.models, job.fixed, job.k,
                                             job.common, self.held, job.b, job.say,
                                             self.ctx.alloc, stages_after)
            least = self.traced_floor[0]
            self.ctx.floor_bytes = min(least, self.margins.least_verified or least)
            if self.on_floor is not None:
                c = self.traced_floor[1]
                self.on_floor({"precision": c.precision, **self._values(c)})
        return self.traced_floor

    def _values(self, choice: Choice) -> dict:
        return knob_values(choice, self.models[choice.key][0].blocks, self.job.k)

    def _planned(self, choice: Choice, est, reasons: list[str]) -> Planned:
        return Planned(_make_plan(self.ctx, choice, est, self.models[choice.key], reasons),
                       self.plain, self.ctx.alloc.under_setting(est), choice.step_s)

    def plain_fits(self) -> Planned | None:
        """The faster plain step that fits (Note 3: auto keeps fp32 where faster), if any."""
        job, ctx = self.job, self.ctx
        if not job.fixed.keep_allowed(self.base.blocks) or job.fixed.offload_optimizer or \
                job.fixed.micro_batch_size not in (None, job.b):
            return None
        fits = [(pair, est, q) for pair, est, q in
                ((self.models[self.key], self.base, job.p), (self.user_pair, self.plain, job.user))
                if ctx.alloc.fits(est, self.held[q], job.budget_bytes)]
        if not fits:
            return None
        pair, est, q = min(fits, key=lambda f: _plain_s(f[0], job.b))
        choice = _as_choice(pair, (q, job.k.optimizer_impl), job.b, est)
        why = ["the plain step fits: nothing to change"] if q == job.user else []
        if q == job.user and job.p != job.user:
            why.append(f"auto keeps {job.user}: the {job.p} step is predicted no faster here")
        return Planned(_make_plan(ctx, choice, est, pair, why), self.plain,
                       ctx.alloc.under_setting(est), choice.step_s)

    def searched(self) -> Planned | None:
        """Search and verify (Notes 1-2, ``planner.verify``), or None when nothing verified."""
        job = self.job
        self.add_precisions()
        self.levers.add_low_bit()
        self.levers.add_chunked_loss()
        self.levers.add_optimizer_in_backward()

        def propose(margins: Margins):
            for q in self.models:
                margins.start(q, self.held[q[0]])
            choice = search(self.models, job.b, job.budget_bytes, job.fixed, margins.bytes)
            for last_resort in (self.levers.add_gradient_offload,      # Note 8
                                self.levers.add_param_offload):
                if choice is None and last_resort():
                    for q in self.models:
                        margins.start(q, self.held[q[0]])
                    choice = search(self.models, job.b, job.budget_bytes, job.fixed,
                                    margins.bytes)
            return choice

        def verify(choice: Choice):
            job.say(f"verifying: re-tracing {describe(choice, job.b)}")
            est = estimate(job.model, job.batch, precision=choice.precision,
                           **self._values(choice), **job.common)
            return est, est.device_bytes + self.held[choice.precision]

        found = verify_loop(propose, verify, lambda c: c.key, self.margins, say=job.say,
                            fits=lambda est, device: self.ctx.alloc.fits(
                                est, device - est.device_bytes, job.budget_bytes))
        if found is None:
            return None
        choice, est = found.candidate, found.trace
        tighter = self.margins.get(choice.key) - self.held[choice.precision]
        reasons = [] if found.attempt == 0 else [
            f"the first {found.attempt} choice(s) re-traced over the budget; the search ran "
            f"again {format_bytes(tighter)} tighter"]
        return weigh(self.remat, self._planned(choice, est, reasons))

    def floor_plan(self) -> Planned:
        """The floor's configuration where it fits, else ``BudgetTooSmall`` (Note 5)."""
        job = self.job
        _, choice, est = self.least()
        if self.ctx.floor_bytes <= job.budget_bytes:
            if est is None:        # extrapolated (a CPU floor): trace it whole
                job.say(f"re-tracing {describe(choice, job.b)}")
                est = estimate(job.model, job.batch, precision=choice.precision,
                               **self._values(choice), **job.common)
            return weigh(self.remat, self._planned(
                choice, est, ["only the least-memory configuration fits"]))
        raise self._too_small(choice)

    def _too_small(self, choice: Choice):
        job, k = self.job, self.job.k
        values = self._values(choice)
        context_bytes = self.models[choice.key][0].context_bytes

        def fits(part, replay=False) -> bool:   # the floor's configuration, shorter
            job.say("tracing the least-memory configuration on shorter sequences")
            est = estimate(job.model, part, precision=choice.precision, allocator_replay=replay,
                           **values, **job.common)
            saved = self.ctx.alloc.saved(est) if replay else 0    # the floor's setting
            return est.device_bytes + self.held[choice.precision] - saved + \
                (context_bytes if not replay else 0) <= job.budget_bytes

        confirm = (lambda part: fits(part, replay=True)) if job.spec.kind == "cuda" else None
        seq = longest_sequence(job.batch, fits, confirm) \
            if job.user_step is None and self.suggest_shorter else None
        # what the weights, gradients and state need on the device: the floor's precision with
        # everything on the device (the floor's own model may hold block weights on the host)
        on_device = self.models.get(choice.key[:2]) or self.models[choice.key]
        layout = None
        if job.user_step is None and job.spec.kind == "cuda" and job.b > 1:   # searched
            job.say("searching layouts of several GPUs (the refusal's sharding line)")
            layout = fewest_gpus(job.model, job.batch, job.common["optimizer"], job.spec,
                                 job.budget_bytes, job.common["loss_fn"],
                                 count_fn=job.common["count_fn"], precision=k.precision)
        user_step = job.user_step is not None
        return too_small(self.ctx.floor_bytes, on_device[0], describe(choice, job.b),
                         job.budget_bytes, excluded_levers(k, job.numerics, user_step), seq,
                         layout=layout, model=job.model,
                         counted=counted_levers(k, job.numerics, user_step,
                                                sorted({q[0] for q in self.models}),
                                                chunked=any(len(q) == 5 for q in self.models),
                                                in_backward=any(len(q) == 6
                                                                for q in self.models)))


def _refuse_below_bound(model, spec, k: Knobs, recipe, trainable, budget_bytes: int,
                        numerics: bool, user_step: bool, precisions,
                        in_backward: bool = False, grads_to_host: bool = False) -> None:
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
                    bound=True, model=model)


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
    fp32_state_bytes: float = 0.0      # the optimizer state as given, on the device
    alloc: AllocatorChoice | None = None   # the allocator setting's choice (_plan_allocator)


def _modelled_impl(recipe: OptimizerRecipe, params, spec) -> str | None:
    """The implementation the optimizer as given runs on ``spec`` (optimizers)."""
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
            fixed.offload_optimizer or spec.kind != "cuda" or \
            k.optimizer_state not in (None, "fp32"):
        return []
    cls = recipe.optimizer_class(params)
    return [i for i in ("fused", "for-loop") if i != default and supports_impl(cls, i)]


def _stages_ahead(job: _PlanCall, variants: int, levers: Levers) -> int:
    """The stages a plan expects where its plain step does not fit (``job.say.expect``): the
    plain traces and the searched precision's half batch (``_models``), each other
    implementation, each other precision (its plain trace unless it is the user's, and its half
    batch), the levers' traces, the search and the verify. An ETA's count: the verify loop's
    second attempt, DTR's batches and the last resorts add stages as they come."""
    half = int(job.b > 1)
    others = sum(half + (q != job.user) for q in job.others)
    return 1 + (job.p != job.user) + half + variants + others + levers.traces_ahead() + 2


def _models(model, batch, est, common, spec, precision: str, b: int, impl, say, state=None):
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


def _user_models(plain, spec, user: str, b: int):
    """Memory and time models of the user's own plain step (Note 3, time_model)."""
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


def _make_plan(ctx: _Context, choice: Choice, est, model_pair, reasons: list[str]) -> Plan:
    memory, time = model_pair
    k, b, held = ctx.knobs, ctx.b, ctx.held[choice.precision]
    values = knob_values(choice, memory.blocks, k)
    knobs = k.replace(precision=choice.precision, **values)
    if ctx.user_step:              # the step's own (Note 7)
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
