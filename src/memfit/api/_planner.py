"""The phases of one ``plan_traced`` call (``api.plan``): ``api._plan_call.PlanCall`` checks
the job once, before any trace, and ``Planner`` traces, models, searches and verifies it.

Note 1 (verification). The re-trace is the answer: its peak and reserved bytes are the plan's
predictions. If it does not fit, the search runs again with the cap lowered by what was
missing (per precision, accumulated): the one verify loop every planner runs
(``planner.verify``); the model's errors cost speed, never the budget. On CPU the re-trace is
exact (track counts the same bytes); on a GPU it is the CUDA model of ``estimate``.

Note 2 (precision "auto"). On a GPU, auto searches the 16-bit precision the card has (bf16, else
fp16 autocast): its matmuls run at least as fast as fp32 (time_model) and its activations
take half the bytes. The "plain step" is always the user's own: fp32 under auto, traced once;
the step-time ratio is against it (time_model), so a plan that changes the precision
says so, and a ratio below 1 is a speed-up. Where the user's plain step fits and is predicted
no slower (a small model, whose casts cost more launches than its matmuls save), auto keeps
it. On the CPU auto is fp32.

Note 3 (the caller's batch). The trace runs the batch as the step uses it: an all-ones
attention mask dropped, bf16-pure's float inputs cast. ``runner.step(batch)`` keeps the
caller's batch alive beside it, so those unused bytes are added to every prediction and check.

Note 4 (the floor). One number: the least device bytes of a configuration in the search
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
``remat=True`` (DTR's floor is its simulation's, Note 8).

Note 5 (the optimizer implementation). With ``optimizer_impl`` unset and the optimizer given
by name or factory, the planner may switch the implementation on a GPU target
(``memfit.optimizers``): each other one the class supports and that may need less than CUDA's
default foreach (fused, for-loop) is traced once (its optimizer step alone:
``estimate(optimizer_only=True)``, without the allocator's replay: the models read its
timeline and op costs, the same with or without), and the search weighs it like any other knob,
before the optimizer state leaves the device; torch's for-loop and fused steps are weighed by
bounds until the search picks one (``api._plan_deferred``). An instance keeps its own unless
``optimizer_impl`` is set.

Note 6 (the user's step). With ``step=fn`` every trace above runs the user's step
(``api._user_step``), the half-batch one on the first half of the batch. The step
fixes its precision, micro-batch size, clipping and zero_grad, so the search keeps the whole
batch in one micro-batch and the user's precision; it weighs only what reaches the step through
the model and the optimizer: per-block keep / recompute / selective / offload (block hooks) and
the optimizer state's placement. The batch is the step's as given (nothing held beside it,
Note 3). The plan's knobs leave ``precision`` and ``micro_batch_size`` unset (the step's own)
and its reasons say so.

Note 7 (every lever, issue 15). Once the plain step does not fit, "auto" also traces the other
precisions it weighs (planner.variants: fp32 where 16-bit gains nothing, bf16-pure where
bf16 is supported); where numerics may change (``allow_numerics_change=True``, implied by
precision "auto") each low-bit optimizer state gets a model (bf16 and 4-bit weighed by bounds
until the search picks one, ``api._plan_deferred``); when nothing fits, the gradients
moved to the host in backward (``offload_gradients``) get one and the search runs again, then,
if still nothing fits, the block weights on the host (parameter offload) (variants). "Nothing
fits" is also every pick of the models missing when re-traced (the verify loop's attempts
spent): llama-1b, 8 x 2 tokens on a GTX 1080 Ti, had five fp16 picks predicted at 10.82 GiB
miss, was refused at the floor's 11.11 GiB, and fits at 8.26 GiB with the gradients on the
host.
The floor counts them all; ``BudgetTooSmall`` names what is beyond them (_plan_words).
A caller's fixed ``optimizer_state`` / ``offload_params`` / ``offload_gradients`` is in every
trace.

Note 8 (DTR). ``remat=True`` plans DTR alone on the whole batch (planner.remat_choice;
with ``BudgetTooSmall`` at DTR's floor). With ``remat`` unset, a static plan that was found is
weighed against DTR over ``batches`` (representative batches of the job, the planned one the
largest) and DTR taken where it is predicted faster (remat_choice). Where every batch
has the same shapes (or none are given) DTR is not weighed: on one batch the static search
already spans what DTR does (whole-block recomputes, remat_choice), so a DTR advantage
there would be the two models' disagreement, not a gain. ``remat=False`` never weighs it.

Note 9 (a fixed quantized base). A ``quantize_base`` set by the caller, or by ``api.plan``'s
last lever (QLoRA), is in every trace: each quantizes a meta twin of the model
(docs/techniques/quantized-base.md), and the bound before tracing (Note 4) counts the twin's
weights.
"""

from __future__ import annotations

import functools

from memfit.api._choice import describe, knob_values
from memfit.api._compare_gpus import fewest_gpus
from memfit.api._floor import least_memory, longest_sequence
from memfit.api._plan_allocator import PLAIN_FITS, AllocatorChoice
from memfit.api._plan_bound import held_back, may_beat
from memfit.api._plan_call import PlanCall
from memfit.api._plan_deferred import Implementations, search_with_bounds
from memfit.api._plan_levers import Levers
from memfit.api._plan_parts import (Context, as_choice, impl_variants, make_plan,
                                    modelled_impl, plain_s, precision_models, stages_ahead,
                                    user_models)
from memfit.api._plan_remat import Planned, RematWeigh, weigh
from memfit.api._plan_words import counted_levers, excluded_levers, too_small
from memfit.api._sharded_models import SHARDED_PRECISIONS
from memfit.api.estimate import estimate
from memfit.planner.choice import Choice
from memfit.planner.search import search
from memfit.planner.verify import Margins, verify_loop
from memfit.units import format_bytes

__all__ = ["Planner"]


class Planner:
    """The search of one ``plan_traced`` call, phase by phase (Notes 1-9)."""

    def __init__(self, job: PlanCall, batches, on_floor, suggest_shorter: bool):
        self.job, self.on_floor, self.suggest_shorter = job, on_floor, suggest_shorter
        k, p, user, b, say = job.k, job.p, job.user, job.b, job.say
        # asked where needed, once (a factory builds the optimizer to answer)
        optimizer_class = functools.cache(lambda: job.recipe.optimizer_class(job.trainable))
        default_impl = modelled_impl(job.recipe, job.trainable, job.spec)
        variants = impl_variants(job.recipe, k, optimizer_class, default_impl, job.fixed,
                                 job.spec)
        self.models, traces = {}, {}
        self.levers = Levers(job.model, job.batch, self.models, traces, job.common, job.spec,
                             b, k, job.numerics, job.user_step is not None, say,
                             optimizer_class)
        self.later = held_back(user, job.others)      # api._plan_bound
        self.key = (p, k.optimizer_impl)
        self.impls = Implementations(variants, optimizer_class() if variants else None,
                                     self.models, self.key, job.trace, say)       # Note 5
        first = [q for q in job.others if q not in self.later]
        say.expect(stages_ahead(b, user, p, first, len(self.impls.now), self.levers))
        say(f"tracing the plain step ({user}, batch {b})")
        self.plain = job.trace(user, optimizer_impl=k.optimizer_impl)
        self.base = self.plain
        if p != user:
            say(f"tracing the plain step ({p}, batch {b})")
            self.base = job.trace(p, optimizer_impl=k.optimizer_impl)
        traces[p] = self.base
        self.models[self.key] = precision_models(job.model, job.batch, self.base, job.common,
                                                 job.spec, p, b, k.optimizer_impl, say,
                                                 job.state)
        for impl in self.impls.now:
            self.impls.trace(impl)
        self.user_pair = self.models[self.key] if p == user else \
            user_models(self.plain, job.spec, user, b)
        self.held = {q: job.held(q) for q in {p, user}}
        self.ctx = Context(k, job.spec, job.budget_bytes, plain_s(self.user_pair, b), b,
                           self.held, user, default_impl,
                           self.plain.device_bytes + self.held[user], bool(variants),
                           job.user_step is not None)
        self.ctx.fp32_state_bytes = self.models[self.key][0].optimizer_state_bytes
        self.ctx.alloc = AllocatorChoice(job.model, job.spec, job.common["allocator"])
        self.remat = None
        if k.remat is not False and job.user_step is None:   # DTR weighed (Note 8)
            self.remat = RematWeigh(job.model, job.batch, batches, self.plain, job.common,
                                    job.spec, user, b, job.budget_bytes, job.state, k, say)
        self.margins = Margins(job.budget_bytes)          # the verify loop's (planner.verify)
        self.traced_floor = None

    def add_precisions(self, held_back=()) -> None:
        """The other precisions "auto" weighs (Note 7), traced once each; ``held_back``: not
        yet (``api._plan_bound``)."""
        job = self.job
        for q in job.others:
            if (q, job.k.optimizer_impl) in self.models or q in held_back:
                continue
            est = self.plain if q == job.user else None
            if est is None:
                job.say(f"tracing the plain step ({q}, batch {job.b})")
                est = job.trace(q, optimizer_impl=job.k.optimizer_impl)
            self.models[(q, job.k.optimizer_impl)] = precision_models(
                job.model, job.batch, est, job.common, job.spec, q, job.b, job.k.optimizer_impl,
                job.say, job.state)
            self.held[q] = job.held(q)
            self.levers.traces[q] = est

    def least(self, stages_after: int = 0):
        """The floor, traced once (Note 4), over every lever: ``(bytes, choice, trace)``.
        ``stages_after``: the stages that follow it (the search and the verify), for the
        ETA's count."""
        if self.traced_floor is None:
            job = self.job
            self.impls.trace_bounded()
            self.add_precisions()
            self.levers.add_low_bit()
            self.levers.states.trace_bounded()
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
        return Planned(make_plan(self.ctx, choice, est, self.models[choice.key], reasons),
                       self.plain, self.ctx.alloc.under_setting(est), choice.step_s)

    def plain_fits(self) -> Planned | None:
        """The faster plain step that fits (Note 2: auto keeps fp32 where faster), if any."""
        job, ctx = self.job, self.ctx
        if not job.fixed.keep_allowed(self.base.blocks) or job.fixed.offload_optimizer or \
                job.fixed.micro_batch_size not in (None, job.b):
            return None
        fits = [(pair, est, q) for pair, est, q in
                ((self.models[self.key], self.base, job.p), (self.user_pair, self.plain, job.user))
                if ctx.alloc.fits(est, self.held[q], job.budget_bytes)]
        if not fits:
            return None
        pair, est, q = min(fits, key=lambda f: plain_s(f[0], job.b))
        choice = as_choice(pair, (q, job.k.optimizer_impl), job.b, est)
        why = [PLAIN_FITS] if q == job.user else []
        if q == job.user and job.p != job.user:
            why.append(f"auto keeps {job.user}: the {job.p} step is predicted no faster here")
        return Planned(make_plan(ctx, choice, est, pair, why), self.plain,
                       ctx.alloc.under_setting(est), choice.step_s)

    def searched(self) -> Planned | None:
        """Search and verify (Note 1, ``planner.verify``), or None when nothing verified."""
        job = self.job
        later = self.later
        self.add_precisions(held_back=later)     # traced if a plan at them may be faster
        self.levers.add_low_bit()
        self.levers.add_chunked_loss()
        self.levers.add_optimizer_in_backward()

        last_resorts = (self.levers.add_gradient_offload,          # Note 7, in this order
                        self.levers.add_param_offload)

        def over_every_model(margins: Margins):
            def over(models):          # the planner's, and bounds (api._plan_deferred)
                for q in models:
                    margins.start(q, self.held[q[0]])
                return search(models, job.b, job.budget_bytes, job.fixed, margins.bytes)
            return search_with_bounds(over, self.models, [self.impls, self.levers.states])

        def propose(margins: Margins):
            choice = over_every_model(margins)
            if any((q, job.k.optimizer_impl) not in self.models for q in later) and \
                    may_beat(self.user_pair, job.b, choice and choice.step_s):
                # the held-back precision may beat this pick (api._plan_bound): traced now;
                # its half batch, in backward, a search and a verify more
                job.say.expect(len(later) * int(job.b > 1) + 3)
                self.add_precisions()
                self.levers.add_optimizer_in_backward()
                choice = over_every_model(margins)
            for last_resort in last_resorts:
                if choice is None and last_resort():
                    choice = over_every_model(margins)
            return choice

        def verify(choice: Choice):
            job.say(f"verifying: re-tracing {describe(choice, job.b)}")
            est = estimate(job.model, job.batch, precision=choice.precision,
                           **self._values(choice), **job.common)
            return est, est.device_bytes + self.held[choice.precision]

        def verified():
            return verify_loop(propose, verify, lambda c: c.key, self.margins, say=job.say,
                               fits=lambda est, device: self.ctx.alloc.fits(
                                   est, device - est.device_bytes, job.budget_bytes),
                               predicted=lambda c: c.device_bytes + self.held[c.precision])

        found = verified()
        for last_resort in last_resorts:        # Note 7: every pick of the models missed when
            if found is None and last_resort():   # re-traced
                found = verified()
        if found is None:
            return None
        choice, est = found.candidate, found.trace
        tighter = self.margins.get(choice.key) - self.held[choice.precision]
        reasons = [] if found.attempt == 0 else [
            f"the first {found.attempt} choice(s) re-traced over the budget; the search ran "
            + (f"again {format_bytes(tighter)} tighter" if choice.key in self.margins.misses
               else "again with their caps lowered by the shortfall and chose another "
                    "configuration")]
        return weigh(self.remat, self._planned(choice, est, reasons))

    def floor_plan(self) -> Planned:
        """The floor's configuration where it fits, else ``BudgetTooSmall`` (Note 4)."""
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
        if job.user_step is None and job.spec.kind == "cuda" and job.b > 1 and \
                k.precision in (None, "auto", *SHARDED_PRECISIONS):    # shardable: searched
            job.say("searching layouts of several GPUs (the refusal's sharding line)")
            layout = fewest_gpus(job.model, job.batch, job.common["optimizer"], job.spec,
                                 job.budget_bytes, job.common["loss_fn"],
                                 count_fn=job.common["count_fn"], precision=k.precision)
        user_step = job.user_step is not None
        return too_small(self.ctx.floor_bytes, on_device[0], describe(choice, job.b),
                         job.budget_bytes, excluded_levers(k, job.numerics, user_step), seq,
                         layout=layout, model=job.model, bare=job.bare_budget,
                         context_bytes=on_device[0].context_bytes,
                         counted=counted_levers(k, job.numerics, user_step,
                                                sorted({q[0] for q in self.models}),
                                                chunked=any(len(q) == 5 for q in self.models),
                                                in_backward=any(len(q) == 6
                                                                for q in self.models)))
