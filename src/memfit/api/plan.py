"""``memfit.plan``: the fastest configuration predicted to fit a budget, verified by a re-trace.

Note 1 (the pipeline). Trace the user's plain step (their precision, the whole effective
batch as one micro-batch; ``Planned.plain``). Under "auto" on a GPU, trace the plain step at
the searched 16-bit precision too. If the searched plain step fits and the caller fixed
nothing that changes it, take it. Else build the memory and time models from those traces
(planner.memory_model, planner.time_model), search (planner.search), and re-trace the step
with the choice applied; the re-trace is the answer. ``api._planner`` runs these phases
(``PlanCall`` checks the job before any trace, ``Planner`` traces, searches and verifies) and
says in its notes how each lever, the floor, the user's step and DTR enter them; this module
is the call, and the last levers with which the whole plan is made again (Notes 2 and 3).

Note 2 (QLoRA). Where numerics may change and the model has frozen float linear layers (a LoRA
or frozen-base job), holding them in NF4 (``quantize_base="nf4"``: QLoRA's bitsandbytes layout,
double quantization, bf16 compute) is the last lever: when no plan fits the float base, the
whole plan is made again with it fixed. Every trace then quantizes a meta twin of the model
(docs/techniques/quantized-base.md), the bound before tracing counts the twin's weights, and
the plan says so first among its reasons. A run of the plan quantizes the model in place. Only
NF4 is weighed (the usual choice, and the smallest with FP4); a caller's own
``quantize_base`` is kept.

Note 3 (a compiled model). Per-block modes are not applied inside a compiled region
(trace.compiled), so a compiled model's plan searches precision, micro-batches and the
optimizer's levers; torch.compile's own lever, ``activation_memory_budget`` (the share of the
activations the min-cut partitioner keeps), is planned as a whole: the plan is made again with
it fixed at each of ``_plan_levers.COMPILE_BUDGETS`` (0.75, 0.5, 0.25, 0.0: the steps
PyTorch's own sweep of the budget takes), each trace then compiling the regions under it. One
fraction serves every region of a group compiled alike: Dynamo runs the first block's compiled
code for the blocks like it, partitioned once (trace.compiled). When nothing fits at torch's
default, the first that fits, the largest budget, is the answer (it recomputes least);
when a plan fits by slowing the step (anything but the plain step), each budget's plan is
weighed against it by predicted step time (``Planned.step_s``, absolute seconds: each plan's
ratio is to the plain step under its own budget) and the fastest is the answer. Either way the
plan's first reason says so. Notes 2 and 3 are one loop: ``_plan_levers.last_levers`` lists
the levers to plan again with, in turn, and which are weighed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from memfit.api._plan_levers import last_levers
from memfit.api._plan_remat import Planned
from memfit.api._plan_sharded import is_sharded, plan_sharded
from memfit.api._plan_call import PlanCall
from memfit.api._planner import Planner
from memfit.api._validate import check_order
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.planner import Plan
from memfit.trace.collector import old_objects_frozen

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
    ``memfit.estimate``, several times; api._planner): only per-block modes and the optimizer's
    placement are searched; ``scheduler``: a factory ``optimizer -> LR scheduler``.
    ``floor=True``: trace the floor (the least any configuration needs, ``Plan.floor_bytes``)
    even when a plan fits; else only when nothing does (api._planner).
    ``allow_numerics_change``: weigh low-bit optimizer states (default: only under
    precision "auto"; api._planner). ``batches``: representative batches of the job, against which
    DTR is weighed (``remat`` unset; ``remat=True`` plans DTR; api._planner).
    ``gpus=N`` or ``"auto"``, ``sharding``: several GPUs (``api._plan_sharded``).
    ``allocator``: a fixed ``AllocatorConfig`` (traced as set); unset, on a GPU the allocator
    setting that reserves least is chosen and counted (``Plan.allocator``, api._plan_allocator).
    """
    check_order("plan", budget=budget)
    if is_sharded(kwargs):
        return plan_sharded(model, batch, budget, optimizer, device, loss_fn, plan_one=plan,
                            **kwargs)
    return plan_traced(model, batch, budget, optimizer, device, loss_fn, **kwargs).plan


@old_objects_frozen()      # no full collection walks what was there before (trace.collector)
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
        job = PlanCall.checked(model, batch, budget, optimizer, device, loss_fn, count_fn,
                                allocator, on_progress, step, scheduler, floor,
                                allow_numerics_change, knobs)
        planner = Planner(job, batches, on_floor, suggest_shorter)
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
    if planned is not None:              # Note 3: weighed against a plan that slows the step
        levers = [lever for lever in levers if lever.weighed and not plain]
        if not levers or planned.step_s is None:
            return planned
    elif not levers:                     # Notes 2 and 3
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
