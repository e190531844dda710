"""``memfit.fit``: wrap the user's model and optimizer in a Runner that fits the budget."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from memfit.api._fit_sharded import fit_sharded, is_sharded
from memfit.api._setup import build_runner, resolve_device, resolve_precision
from memfit.api._user_step import STEP_FIXED_NOTE, as_user_step, check_step_knobs
from memfit.api._validate import check_batch, check_order
from memfit.api.plan import plan
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe, impl_of
from memfit.planner import Plan
from memfit.runtime import Runner
from memfit.runtime.batch_shape import extend_batch
from memfit.runtime.oom_guard import replan_shortfall
from memfit.step import prepare_batch
from memfit.techniques.accumulation import Accumulation, batch_size_of
from memfit.units import format_bytes, parse_bytes

__all__ = ["fit"]


def fit(model: nn.Module, optimizer, batch, budget=None, device=None,
        loss_fn: Callable | None = None, *, count_fn: Callable | None = None, scheduler=None,
        max_seq_len: int | None = None, step: Callable | None = None,
        allow_numerics_change: bool | None = None, batches=None, **knobs) -> Runner:
    """A ``Runner`` that trains ``model`` one effective batch per ``runner.step(batch)``.

    ``optimizer``: an instance over the model's parameters (rebuilt only when a knob needs
    new parameters, e.g. bf16-pure master weights; ``runner.plan`` says so), or a factory
    ``params -> Optimizer``. ``batch``: an example effective batch (Mapping -> ``model(**batch)``
    and ``.loss``; else pass ``loss_fn(model, batch)``). ``budget``: device bytes ("11GiB"):
    ``memfit.plan`` picks the fastest configuration predicted (and re-traced) to fit, keeping
    the knobs given here; below the floor it raises ``memfit.BudgetTooSmall``.
    ``count_fn(batch)``: what the loss averages over (default: what the model's loss counts).
    ``scheduler``: an LR scheduler (or a factory ``optimizer -> scheduler``, needed with
    bf16-pure and offload_optimizer, which rebuild the optimizer) stepped once per effective
    batch. ``max_seq_len``: plan for the example extended to this many tokens (dynamic
    padding: the longest batch), built on the ``meta`` device (runtime.batch_shape); a
    batch larger than the one planned for warns in ``runner.step``.
    Knobs (``memfit.Knobs``): ``precision``, ``micro_batch_size``, ``max_grad_norm``,
    ``checkpoint``, ``offload``, ``offload_optimizer``, ``remat`` (DTR around each step: under
    ``budget`` if given, else on out-of-memory), ``zero_grad`` (the loop style: "before-forward",
    the default, "after-forward" or "keep-buffers"), ``optimizer_state`` (bitsandbytes' 8-bit,
    torchao's 4-bit and bf16 Adam/AdamW: changes the numerics), ``offload_params`` (block
    weights on the host, with ``offload_optimizer``; ``runner.close()`` takes its hooks off:
    until then the model's offloaded weights are placeholders), ``optimizer_in_backward`` (one
    optimizer per parameter stepped by its gradient hook: ``runner.optimizer`` is the wrapper;
    no re-plan on out-of-memory). Everything is checked before the model is touched.
    ``gpus``, ``sharding``, ``reshard_after_forward``, ``fsdp_offload``: inside each rank of
    a job (``init_process_group`` first), the plan applied with FSDP2 or DDP over the job's
    ranks; ``batch`` is this rank's (``memfit.api._fit_sharded``).

    ``allow_numerics_change``, ``batches``: as ``memfit.plan`` takes them (low-bit optimizer
    states weighed; the workload's batches, against which DTR is weighed), for the plan made
    under ``budget``, and for each re-plan after an out-of-memory error.

    On a GPU the plan may pick a caching-allocator setting (``runner.plan.allocator``): its
    ``MemPool``s are entered around the step's phases; ``expandable_segments`` is weighed only
    as the running allocator has it (a model on the GPU has started CUDA): export
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before starting Python to let memfit
    use it (``memfit.api._plan_allocator``).

    ``step=fn``: the user's own training step ``fn(model, batch, optimizer)``; the plan is made
    for it (``memfit.plan(step=fn)``: per-block modes and the optimizer's placement only) and
    ``runner.step(batch)`` calls ``fn(runner.model, batch, runner.optimizer)`` with the plan
    applied through block hooks and the optimizer (runner), then steps ``scheduler``;
    it returns what ``fn`` returned, as a float (NaN for None). Use ``runner.optimizer``
    (it is rebuilt when the optimizer state is offloaded) and ``runner.close()`` to remove
    the hooks. There is no re-plan on out-of-memory for a user step.
    """
    check_order("fit", optimizer=optimizer, batch=batch)
    knobs_in = Knobs.from_kwargs(**knobs)
    knobs_in.check_available()
    planning = {n: v for n, v in (("allow_numerics_change", allow_numerics_change),
                                  ("batches", batches)) if v is not None}
    if is_sharded(knobs_in):          # one rank of a torchrun job (api._fit_sharded)
        if step is not None or max_seq_len is not None:
            raise ValueError("step and max_seq_len with gpus/sharding are not supported yet")
        return fit_sharded(model, optimizer, batch, budget, device, loss_fn, knobs_in,
                           count_fn=count_fn, scheduler=scheduler)
    user = as_user_step(step)
    if user is not None:
        if max_seq_len is not None:
            raise ValueError("max_seq_len with step=fn: pass the longest batch itself (the "
                             "step is traced on the batch as given)")
        knobs_in = check_step_knobs(knobs_in, batch_size_of(batch), loss_fn)
    spec = resolve_device(model, device)
    k = knobs_in.replace(precision=resolve_precision(knobs_in.precision, spec))
    low_bit = k.optimizer_state not in (None, "fp32")
    if (k.precision == "bf16-pure" or k.offload_optimizer or low_bit or
            k.optimizer_in_backward) and hasattr(scheduler, "step"):
        raise ValueError(
            "bf16-pure, offload_optimizer, optimizer_in_backward and a low-bit optimizer_state "
            "rebuild the optimizer, "
            "so a scheduler built on the one passed in would drive nothing: pass scheduler=a "
            "factory, e.g. "
            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)")
    recipe = OptimizerRecipe(optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    recipe.check_params(trainable)
    if k.optimizer_impl is not None and hasattr(scheduler, "step") and \
            impl_of(optimizer, cuda=spec.kind == "cuda") != k.optimizer_impl:
        raise ValueError(
            f"optimizer_impl={k.optimizer_impl!r} rebuilds the optimizer, so a scheduler built "
            "on the one passed in would drive nothing: pass scheduler=a factory, e.g. "
            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10), or build the optimizer with "
            "that implementation yourself")
    example = prepare_batch(batch) if user is None else batch
    if user is None:
        check_batch(model, example, loss_fn)
    planned, shapes = batch, batch          # what is traced; the shapes runner.step compares
    if max_seq_len is not None:             # batch_shape: the all-ones mask goes first
        planned, shapes = extend_batch(example, max_seq_len), extend_batch(batch, max_seq_len)
        check_batch(model, planned, loss_fn)
    plan = Plan(k, device=spec.name, batch_size=batch_size_of(example),
                budget_bytes=parse_bytes(budget) if budget is not None and k.remat else None)
    if budget is not None and not k.remat:    # DTR keeps the budget at run time: nothing to plan
        if hasattr(scheduler, "step"):          # a rebuilt optimizer would orphan the scheduler
            knobs_in = knobs_in.replace(
                offload_optimizer=knobs_in.offload_optimizer or False,
                optimizer_in_backward=knobs_in.optimizer_in_backward or False)
        k, plan = _fit_budget(model, optimizer, planned, spec, loss_fn, count_fn, knobs_in,
                              parse_bytes(budget), user, scheduler, planning)
    if user is None:
        Accumulation(Accumulation.Config(k.micro_batch_size)).warn_if_inexact(model, example)
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    replan = None
    if budget is not None and not k.remat and user is None and not k.optimizer_in_backward:
        replan = _replanner(model, recipe, optimizer, planned, spec, loss_fn, count_fn,
                            knobs_in.replace(precision=k.precision,
                                             offload_optimizer=k.offload_optimizer,
                                             optimizer_impl=k.optimizer_impl),
                            parse_bytes(budget), device_type, planning)
    notes = []
    if budget is not None and k.optimizer_in_backward:
        notes.append("optimizer_in_backward: no re-plan on out-of-memory (a batch that runs out "
                     "in backward has already stepped some parameters)")
    if user is not None:
        notes.append(f"step=fn: runner.step calls {user.name}(runner.model, batch, "
                     "runner.optimizer) as written; " + STEP_FIXED_NOTE.split(": ", 1)[1] +
                     ("; no re-plan on out-of-memory (what the step keeps could not be "
                      "restored)" if budget is not None else ""))
    return build_runner(model, recipe, k, plan=plan, loss_fn=loss_fn, count_fn=count_fn,
                        scheduler=scheduler, device_type=device_type, replan=replan,
                        planned_batch=shapes, user_step=user, notes=notes)


def _replanner(model, recipe, optimizer, batch, spec, loss_fn, count_fn, fixed: Knobs,
               budget: int, device_type: str, planning: dict):
    """The OOM guard's ``replan(excess)``: plan again with the budget lowered by every excess
    measured so far, precision and optimizer placement kept (the optimizer and its state carry
    over), and build the new Runner over the same model."""
    missing = [0]

    def replan(excess: int):
        missing[0] = replan_shortfall(missing[0], excess, budget)
        k, plan = _fit_budget(model, optimizer, batch, spec, loss_fn, count_fn, fixed,
                              budget - missing[0], planning=planning)
        # the plan says what it was searched under; the runner holds the real budget
        note = (f"re-planned after running out of memory: planned under "
                f"{format_bytes(budget - missing[0])}, {format_bytes(missing[0])} below the "
                f"{format_bytes(budget)} budget")
        return build_runner(model, recipe, k, plan=plan, loss_fn=loss_fn, count_fn=count_fn,
                            device_type=device_type, budget_bytes=budget, notes=[note])
    return replan


def _fit_budget(model, optimizer, batch, spec, loss_fn, count_fn, k: Knobs, budget: int,
                step=None, scheduler=None, planning: dict | None = None):
    """The planner's fastest configuration that fits ``budget`` (knobs the caller set kept);
    for a user ``step``, with its ``scheduler`` factory (an instance cannot be traced, and an
    LR scheduler holds no tensors)."""
    fixed = {name: v for name, v in k.to_dict().items() if v is not None}
    if step is not None:
        fixed.update(step=step, scheduler=None if hasattr(scheduler, "step") else scheduler)
    p = plan(model, batch, budget, optimizer, spec, loss_fn, count_fn=count_fn, **fixed,
             **(planning or {}))
    return p.knobs, p
