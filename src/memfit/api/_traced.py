"""One traced step and the figures of an ``Estimate`` made from it (``memfit.estimate``).

``trace_step`` traces one steady-state step on fakes and returns what it traced (``Traced``);
``figures`` makes the ``Estimate`` from a traced step's profile and tracker, or from a step
composed of a shallow twin's pieces (``api._blockwise``) with the same code.

Note 1 (the optimizer phase alone). ``optimizer_only`` traces what the step does once its
gradients are made (``Runner.optimizer_phase``: unscale, clip, the optimizer step, the scale
update, the scheduler) from the steady state the warm-up leaves: the optimizer state made, every
gradient alive, as backward leaves them. Its timeline is that phase's alone
(``phases == {"optimizer": 0}``), starting from ``start_breakdown``. The planner's models of
another optimizer implementation or state read only that phase (planner.variants), so the
forward and backward are not traced again; tests/api/test_optimizer_only.py holds it to the
whole step's phase. There is no allocator replay (it needs the whole step's history). Where
the step has no such phase of memfit's own (a user's ``step=fn``, the optimizer stepped in
backward, the gradients moved to the host as backward makes them, a rank of several GPUs), the
whole step is traced: its readers take the phase from ``phases["optimizer"]`` either way.
The phase alone reads no batch (nor says anything of it: no packing note), so ``estimate``
keys its cache entry without one, and every batch of the model reads it.

Note 2 (a GPU rank's optimizer). memfit's CUDA models are not applied to a rank of several
GPUs, but the optimizer's implementation is: a GPU rank steps torch's default, ``foreach``,
over its shards (torch counts DTensor among the types ``foreach`` takes, and the shards are on
the GPU), where the trace's fakes, on the CPU, would take the for-loop and miss the
``foreach`` temporaries that span every parameter. Under FSDP2's CPU offload the shards step
on the host, for-loop, as the trace's default does.

Note 3 (one step for a replay). A GPU target's replay needs the step before the counted one.
Where ``trace.first_step`` can make it from the counted step (an optimizer it knows, and not
a user's step, a compiled model, a rank or a shared symbolic trace), one step is traced after
the warm-up, with the marks it needs, and the first step is made on its tracker: here for a
step traced whole, in ``api._blockwise`` for a step composed from twins. Where it cannot
(``NotMade``), the step is traced again with two steps.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

from memfit.api._estimate_result import Estimate
from memfit.api._setup import build_runner, resolve_device, resolve_precision
from memfit.api._rank_layout import RankLayout
from memfit.api._step_args import checked_step, described
from memfit.api._user_step import (check_cuda_autocast, explain_step_error, step_notes,
                                   with_backward_phase)
from memfit.errors import TraceError
from memfit.knobs import Knobs
from memfit.measure._cpu_scratch import target as scratch_target
from memfit.memplan import storage_log
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.techniques._torchao_user import step_note as torchao_note
from memfit.techniques.compiled_optimizer import step_note as compiled_step_note
from memfit.techniques.quantized_base import QuantizedBase
from memfit.trace import FakeCopier, profile_step
from memfit.trace.card import card_breakdown
from memfit.trace._compile_garbage import CompileGarbage
from memfit.trace._counted_compile import compiled_trace, eager_calls_note, eager_compiled_calls
from memfit.trace.compiled import (check_budget, compile_failure, compiled_note, graph_pool_bound,
                                   compiled_regions, eager_view, refuse_with_compiled,
                                   wrap_regions)
from memfit.trace.cuda import CudaModel
from memfit.trace.dtr_sim import simulate_dtr, spans_from_modules
from memfit.trace.first_step import NotMade, Recorder, may_make
from memfit.trace.first_step import make as make_first_step
from memfit.trace.per_parameter import repeats_allowed
from memfit.trace._layerdrop import without_layerdrop
from memfit.trace.packed_attention import check_attention_device, packing_note, uses_cache
from memfit.trace.scaler import TraceGradScaler, warm_up_scaled
from memfit.units import parse_bytes
from memfit.units import format_bytes

__all__ = ["phase_alone", "Traced", "trace_step", "figures"]


@dataclass
class Traced:
    """What ``trace_step`` traced, and what ``figures`` needs of it."""

    spec: object
    knobs: Knobs
    user: object
    layout: RankLayout | None
    cuda: CudaModel | None
    runner: object
    quantized: object
    limit: int
    budget: object
    batch: object
    replay: bool
    prof: object
    tracker: object
    knobs_blocks: dict
    sdpa_calls: list            # the attention kernel of each SDPA call, on a GPU target
    unified_bytes: int          # paged optimizer state, on a GPU target
    traced_as: str = "whole"
    regions: tuple = ()         # the compiled regions (trace.compiled), traced as compiled
    eager_calls: tuple = ()     # compiled code the step called that ran eagerly (trace.compiled)
    garbage_bytes: int = 0      # what a compile's garbage holds through the step (trace.compiled)
    layerdrop: tuple = ()       # LayerDrop probabilities set to 0 in the trace (trace._layerdrop)
    warmed_all: bool = False    # its warm-up gave every trainable parameter a gradient, and the
                                # counted step ran backward (``trace_step``)
    first_made: bool = False    # its replay's first step is to be made (Note 3)


def phase_alone(k: Knobs, step=None, layout: RankLayout | None = None) -> bool:
    """Whether the step has an optimizer phase of memfit's own to trace alone (Note 1): not a
    user's step, the optimizer in backward, the gradients moved to the host as backward makes
    them, or a rank of several GPUs."""
    return (layout or RankLayout.of(k)) is None and step is None and \
        not k.optimizer_in_backward and not k.offload_gradients


def trace_step(model, batch, optimizer, device, loss_fn, k: Knobs, copier: FakeCopier,
               **kwargs) -> Traced:
    """One step traced on fakes made by ``copier`` (``estimate`` says what each argument
    does); ``blocks``: label the tracker's storages with these block names
    (``trace.block_reuse``). With a data-parallel ``layout`` (default: the one the knobs
    ``gpus``, ``sharding``... ask for), one rank of it: the same trace on the fake model sharded
    by ``techniques.sharding`` (``api._rank_layout``). ``optimizer_only``: the step's
    optimizer phase alone (Note 1). A step that left trainable parameters without a gradient
    is traced again, its warm-up leaving them without one or optimizer state (a real step
    gives them neither; ``trace.profile``)."""
    t = _trace_once(model, batch, optimizer, device, loss_fn, k, copier, **kwargs)
    if t.warmed_all and t.tracker.ungraded:
        t = _trace_once(model, batch, optimizer, device, loss_fn, k, copier,
                        skip=frozenset(t.tracker.ungraded), **kwargs)
    if t.first_made and kwargs.get("blocks") is None:    # a twin's is made once composed
        try:
            make_first_step(t.tracker)
        except NotMade:            # traced again, two steps, on fakes of its own
            kwargs["first_step"] = False
            return trace_step(model, batch, optimizer, device, loss_fn, k,
                              FakeCopier(copier.device), **kwargs)
    return t


def _trace_once(model, batch, optimizer, device, loss_fn, k: Knobs, copier: FakeCopier, *,
                budget=None, count_fn=None, allocator=None, allocator_replay=True, step=None,
                scheduler=None, cuda_version=None, layout: RankLayout | None = None,
                blocks: list[str] | None = None, optimizer_only: bool = False,
                skip=frozenset(), first_step: bool = True) -> Traced:
    """``trace_step``'s trace; ``skip``: parameters the warm-up leaves without a gradient;
    ``first_step``: a replay's first step may be made from the counted one (Note 3)."""
    k.check_available()
    layout = layout or RankLayout.of(k)
    if layout is not None:
        layout.refuse(k, step=step, scheduler=scheduler, allocator=allocator)
    if not phase_alone(k, step, layout):
        optimizer_only = False        # Note 1: no optimizer phase to trace alone
    spec = resolve_device(model, device, cuda_version)        # checks the model first
    regions = compiled_regions(model)          # a backend memfit does not model: refused
    user, k, batch = checked_step(model, batch, loss_fn, k, step, scheduler,
                                   compiled=bool(regions))
    k = k.replace(precision=resolve_precision(k.precision, spec))
    if layout is not None:
        layout.check_precision(k.precision)
    limit = parse_bytes(budget) if budget is not None else spec.usable_bytes
    recipe = OptimizerRecipe(optimizer, impl=k.optimizer_impl)
    trainable = [p for p in model.parameters() if p.requires_grad]
    recipe.check_params(trainable)
    recipe.check_impl(trainable)
    check_budget(k, regions)
    if regions:
        refuse_with_compiled(k, layout, regions, model)
        model = eager_view(model, regions)
    model, quantized = _quantized_twin(model, k, layout)

    # memfit's CUDA models are not applied to a sharded rank yet (api._rank_layout says why)
    cuda = CudaModel(spec, allocator) if spec.kind == "cuda" and layout is None else None
    check_attention_device(model, spec.kind, sharded=layout is not None)
    replay = cuda is not None and allocator_replay and not optimizer_only
    compiled: list[str] = []                  # the regions whose graphs were compiled
    eager_calls: list[str] = []               # compiled code that ran eagerly (trace.compiled)
    with contextlib.ExitStack() as stack:     # a rank's fake process group, until counted
        stack.enter_context(scratch_target(spec.kind))   # a GPU's trace runs no CPU kernel
        stack.enter_context(eager_compiled_calls(eager_calls))
        fake_model = copier.module(model)
        fake_model.train(model.training)
        layerdrop = without_layerdrop(fake_model) if model.training else ()
        garbage = None
        if regions:
            stack.enter_context(compiled_trace())
            garbage = stack.enter_context(CompileGarbage())
            fake_model = wrap_regions(fake_model, regions, compiled,
                                      k.activation_memory_budget)
        fake_batch = copier.tree(batch)
        if layout is not None:
            fake_model = layout.shard(stack, fake_model, copier)
        with copier.mode:
            runner = build_runner(fake_model, recipe, k, plan=Plan(k), origin=trainable,
                                  loss_fn=loss_fn, count_fn=count_fn,
                                  scaler_class=TraceGradScaler,
                                  autocast_impl=cuda.autocast if cuda else None,
                                  recompute_context=cuda.recompute if cuda else None,
                                  scheduler=scheduler, user_step=user)
            fake_batch = runner.prepare(fake_batch)
        if cuda:
            cuda.use_foreach(runner.optimizer)
        elif spec.kind == "cuda" and layout is not None and not layout.config.offload:
            CudaModel.use_foreach(runner.optimizer)   # a GPU rank's default too (Note 2)
        placement = layout.placement(runner, spec) if layout is not None else None

        made = replay and first_step and user is None and not regions and layout is None and \
            getattr(copier, "shape_env", None) is None and may_make(runner.optimizer)
        recorder = Recorder(runner.model, runner.optimizer, runner.scaler) if made else None

        def run(on_phase):
            try:
                counted(on_phase)
            finally:
                if recorder is not None:
                    recorder.after_step()

        def counted(on_phase):
            with cuda.kernels() if cuda else contextlib.nullcontext(), \
                    placement.step(on_phase) if placement else \
                    contextlib.nullcontext(on_phase) as mark:
                if optimizer_only:            # Note 1
                    mark("optimizer")
                    with repeats_allowed():   # each kind of parameter's update traced once
                        runner.optimizer_phase()
                else:
                    runner.run(fake_batch, mark)
                if runner.scheduler is not None:
                    runner.scheduler.step()

        def between_steps(tracker):
            if garbage is not None:           # what the compile left, alive as in a real run
                garbage.keep()
            if cuda is None:
                return
            for t in cuda.host_tensors(runner.optimizer):
                tracker.mark_host(t)
            for t in cuda.unified_tensors(runner.optimizer):
                tracker.mark_unified(t)
            if recorder is not None:
                recorder.on_state(tracker)

        # steady state: optimizer state exists (and, under fp16, the scaler's scale: a warm-up
        # without a step, scaler); for a GPU, two whole steps for the allocator's history
        # (cuda); a rank, one micro-batch (RankLayout.warm_up). A user step always
        # runs twice (_user_step), and so does a compiled model: Dynamo compiles in the first
        # and leaves garbage holding what it compiled (trace._compile_garbage)
        two_steps = (replay and not made) or user is not None or garbage is not None
        warm_up = None
        if layout is not None:
            warm_up = lambda: layout.warm_up(runner, fake_batch, copier)  # noqa: E731
        elif runner.scaler is not None:
            warm_up = lambda: warm_up_scaled(runner.model, runner.optimizer,  # noqa: E731
                                             runner.scaler, skip)
        try:
            prof, tracker = profile_step(run, copier=copier, model=runner.model,
                                         optimizer=runner.optimizer, warm_up=warm_up,
                                         two_steps=two_steps,
                                         on_state=between_steps,
                                         blocks=blocks, skip=skip)
        except Exception as e:
            if user is not None and (clear := explain_step_error(e, user)) is not None:
                raise clear from e
            if regions and type(e).__module__.startswith("torch._dynamo"):
                raise TraceError(compile_failure(e, regions)) from e
            raise described(e, model, batch, loss_fn)
        if regions and not compiled:
            raise TraceError(f"torch.compile ran {regions[0].describe()} eagerly in the trace "
                             f"(Dynamo compiled none of its graphs), so memfit cannot say what "
                             f"the compiled step holds; run with TORCH_LOGS=graph_breaks to see "
                             f"why, or estimate the model uncompiled")
    return Traced(spec=spec, knobs=k, user=user, layout=layout, cuda=cuda, runner=runner,
                  quantized=quantized, limit=limit, budget=budget, batch=batch, replay=replay,
                  prof=prof, tracker=tracker, knobs_blocks=dict(runner.applied.blocks),
                  sdpa_calls=list(cuda.sdpa_calls) if cuda else [],
                  unified_bytes=cuda.unified_bytes(runner.optimizer) if cuda else 0,
                  regions=tuple(regions), eager_calls=tuple(eager_calls),
                  garbage_bytes=garbage.kept_bytes if garbage is not None else 0,
                  layerdrop=layerdrop, first_made=made,
                  warmed_all=not skip and layout is None and not optimizer_only and
                  not two_steps)


def figures(t: Traced) -> Estimate:
    """The ``Estimate`` of a traced (or composed) step."""
    spec, k, user, layout, cuda, runner = t.spec, t.knobs, t.user, t.layout, t.cuda, t.runner
    batch, limit, prof, tracker = t.batch, t.limit, t.prof, t.tracker
    if user is not None:
        if spec.kind == "cuda":
            check_cuda_autocast(user, spec.display_name)       # memfit.step
        prof.phases = with_backward_phase(prof.phases, prof.modules)
    peak, reserved, breakdown, context = prof.peak_bytes, prof.peak_bytes, prof.breakdown, 0
    notes, card = [], None
    if layout is not None:      # the card around the allocator, as for one device
        reserved, context, card, notes = layout.card(peak, prof.op_log, spec)
    if t.replay:
        peak, reserved, breakdown, context, card, notes = _on_the_card(t)
    alone = prof.phases == {"optimizer": 0}          # Note 1: the phase alone reads no batch
    packed = None if alone else packing_note(runner.model, batch, cuda and t.sdpa_calls,
                                             cuda and spec.display_name)
    notes += [packed] if packed else []
    notes += list(t.quantized.notes) if t.quantized else []
    for note in (torchao_note(runner.optimizer, spec.kind),
                 compiled_step_note(runner.optimizer, spec.kind)):
        notes += [note] if note else []
    graphs = any(r.cuda_graphs for r in t.regions)
    compiled = compiled_note(list(t.regions), spec.kind, t.garbage_bytes,
                             t.garbage_bytes > 0 and uses_cache(runner.model, batch),
                             graph_pool_bound(prof.op_costs, prof.start_breakdown)
                             if graphs else 0)
    notes += [compiled] if compiled else []
    eager = eager_calls_note(list(t.eager_calls))
    notes += [eager] if eager else []
    if t.layerdrop:
        notes.append(f"LayerDrop ({', '.join(t.layerdrop)}) is off in the trace: the figures are "
                     "of a step that runs every layer, the most any training step holds")
    if user is not None:
        notes += step_notes(user, batch)
    sim = None
    if k.remat and t.budget is not None:      # DTR replayed on the traced timeline
        sim = simulate_dtr(prof.timeline, spans_from_modules(prof.modules, prof.blocks), limit)
        notes.append(_remat_note(sim, limit))
    est = Estimate(
        remat_peak_bytes=sim and sim.peak_bytes, remat_floor_bytes=sim and sim.floor_bytes,
        remat_recompute_flops=sim and sim.recompute_flops,
        peak_bytes=peak, reserved_bytes=reserved, breakdown=breakdown, context_bytes=context,
        host_peak_bytes=prof.host_peak_bytes,
        timeline=prof.timeline, op_log=prof.op_log, timeline_by_category=prof.timeline_by_category,
        phases=prof.phases, modules=prof.modules, blocks=prof.blocks, fw_flops=prof.fw_flops,
        bw_flops=prof.bw_flops, device=spec, limit_bytes=limit, knobs=k,
        trace_seconds=prof.trace_seconds, notes=notes,
        basis="cuda-model" if cuda else "cpu-trace", knobs_blocks=t.knobs_blocks,
        op_costs=prof.op_costs, start_breakdown=prof.start_breakdown, card=card, lifetimes=storage_log(tracker),
        traced_as=t.traced_as,
    )
    return est


def _on_the_card(t: "Traced"):
    """A GPU target's figures from the caching allocator's replay: (allocated peak, reserved
    peak, breakdown, bytes outside the allocator, the card, notes)."""
    cuda, spec = t.cuda, t.spec
    mem = cuda.replay(t.tracker)
    card = card_breakdown(spec, mem.reserved_peak_bytes, t.prof.op_log, mem.workspace_bytes,
                          t.unified_bytes)
    where = f"measured in {spec.profile_path}" if spec.profile_path else \
        "from public measurements"
    attention = _describe_calls(t.sdpa_calls) if t.sdpa_calls or not cuda.flash_note \
        else "flash-attn 2 (its note follows)"
    notes = [f"CUDA model of the {spec.display_name}: attention ran {attention}; optimizer "
             f"{cuda.optimizer_impl(t.runner.optimizer)}; caching-allocator "
             f"replay; context and library kernels {where}. Unvalidated until "
             "benchmarks/gpu_check.py (or memfit calibrate) has run on this GPU"]
    notes += [cuda.bnb_note] if cuda.bnb_note else []
    notes += [cuda.flash_note] if cuda.flash_note else []
    notes += _int8_note(t.runner.model, spec)
    notes += list(card.notes)
    return (mem.allocated_peak_bytes, mem.reserved_peak_bytes, mem.breakdown,
            card.outside_allocator_bytes, card, notes)


def _quantized_twin(model, k: Knobs, layout):
    """``(the model to trace, the Change)``: with ``quantize_base``, a quantized copy of the
    model on meta (a trace quantizes a twin, a run the model itself:
    docs/techniques/quantized-base.md); else the model and None."""
    if k.quantize_base in (None, "none"):
        return model, None
    if layout is not None:
        raise ValueError(f"quantize_base={k.quantize_base!r} with several GPUs (gpus, "
                         "sharding) is not supported yet: quantize on one device, or "
                         "leave quantize_base unset")
    return QuantizedBase(QuantizedBase.Config(kind=k.quantize_base)).twin(model)


def _remat_note(sim, limit: int) -> str:
    return (f"remat: DTR simulated under {format_bytes(limit)}: peak "
            f"{format_bytes(sim.peak_bytes)}, {sim.evictions} evictions, "
            f"{sim.recompute_flops:,} recompute FLOPs, floor {format_bytes(sim.floor_bytes)}"
            + ("" if sim.feasible else " (the budget is below it)"))


def _int8_note(model, spec) -> list[str]:
    """LLM.int8 layers on a GPU target are traced through bitsandbytes' CPU branch
    (``memfit.trace.cuda_bnb`` says why)."""
    if not any(type(m).__name__ == "Linear8bitLt" for m in model.modules()):
        return []
    return [f"LLM.int8 layers: traced as bitsandbytes trains them on the CPU (dequantize, then "
            f"a float matmul), not its CUDA path on the {spec.display_name} (int8 matmul with "
            "16-bit outlier columns): their temporaries are the CPU path's"]


def _describe_calls(calls: list[str]) -> str:
    if not calls:
        return "no SDPA"
    return ", ".join(f"{n}x {b}" for b, n in sorted(Counter(calls).items()))


