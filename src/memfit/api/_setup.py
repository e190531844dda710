"""What estimate and fit share: resolving the device and precision, building the Runner."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from memfit.api._plan_allocator import apply_allocator
from memfit.zoo._model_arg import check_model
from memfit.devices import DeviceSpec, cpu_spec, get_device, with_cuda
from memfit.knobs import Knobs
from memfit.modes import Mode
from memfit.optimizers import IMPL_FLAGS, OptimizerRecipe
from memfit.planner import Plan
from memfit.runtime import Applied, Runner
from memfit.runtime.batch_shape import BatchShapes
from memfit.techniques import Change
from memfit.techniques._bnb_optimizer import BnbRecipe, is_bnb, may_make_bnb
from memfit.techniques._torchao_optimizer import is_torchao
from memfit.techniques._torchao_user import TorchaoRecipe, may_make_torchao
from memfit.techniques.accumulation import Accumulation
from memfit.techniques.checkpoint import Checkpoint
from memfit.techniques.compiled_optimizer import CompiledStepRecipe, user_region
from memfit.techniques.chunked_loss import ChunkedLoss
from memfit.techniques.low_bit_optimizer import LowBitOptimizer
from memfit.techniques.offload import Offload
from memfit.techniques.optimizer_in_backward import OptimizerInBackward, check_knobs
from memfit.techniques.optimizer_offload import OptimizerOffload
from memfit.techniques.param_offload import ParamOffload
from memfit.techniques.precision import MasterWeightsOptimizer, Precision
from memfit.techniques.quantized_base import QuantizedBase
from memfit.techniques.remat import Remat

__all__ = ["resolve_device", "resolve_precision", "build_runner"]


def resolve_device(model: nn.Module, device, cuda_version=None) -> DeviceSpec:
    """``device`` (a name, "cpu", "cuda", a profile FILE.json, a DeviceSpec), else where the
    model is; ``cuda_version`` ("12.4") sets the CUDA its context figures assume
    (``memfit.devices.with_cuda``; refused for the CPU). Every front asks this first, so
    it refuses what is not a model (``zoo._model_arg.check_model``)."""
    check_model(model)
    if device is not None:
        spec = get_device(device)
    else:
        spec = cpu_spec()
        for p in model.parameters():
            if p.device.type == "cuda":
                spec = get_device(p.device)
            break
    return spec if cuda_version is None else with_cuda(spec, cuda_version)


def resolve_precision(precision: str | None, spec: DeviceSpec) -> str:
    """The user's choice (default fp32), checked against the device; "auto" picks bf16 on a
    GPU that has it, else fp16 on a GPU, else fp32 (the planner will weigh it later)."""
    if precision in (None, "fp32"):
        return "fp32"
    if precision == "auto":
        if spec.kind != "cuda":
            return "fp32"
        return "bf16" if spec.supports_bf16 else "fp16"
    if precision.startswith("bf16") and not spec.supports_bf16:
        raise ValueError(f"precision {precision!r} needs bf16 support, which the "
                         f"{spec.display_name} ({spec.architecture}) lacks: use precision='fp16' "
                         "or 'fp32'")
    return precision


def build_runner(model: nn.Module, recipe: OptimizerRecipe, knobs: Knobs, *, plan: Plan,
                 origin: list[torch.Tensor] | None = None, loss_fn: Callable | None = None,
                 count_fn: Callable | None = None, scheduler=None, scaler_class=None,
                 device_type: str = "cpu", autocast_impl=None, recompute_context=None,
                 replan=None, budget_bytes: int | None = None, notes=(),
                 planned_batch=None, user_step=None) -> Runner:
    """Apply the knobs to ``model`` (in place) and wrap it in a Runner.

    ``plan`` is not changed (a ``Plan`` is frozen): what applying it did is ``runner.applied``, with
    ``notes`` first and the budget the Runner holds (``budget_bytes``, default the plan's).
    ``autocast_impl`` (dtype -> context) and ``recompute_context`` (dtype or None -> context
    entered around each checkpoint recompute) let a trace model another device's autocast and
    kernels; real runs leave them None (torch.autocast is replayed by checkpoint itself).
    ``replan(excess_bytes) -> Runner`` arms the Runner's OOM guard (runtime.oom_guard).
    ``planned_batch``: the batch the plan was made for; a larger one warns (batch_shape).
    ``user_step`` (``memfit.step.UserStep``): run it instead of memfit's loop, on the batch as
    given; the plan reaches it through the block hooks and the optimizer. A user's optimizer
    whose step is compiled (``opt.step = torch.compile(opt.step)``) runs as
    ``optimizer_impl="compiled"`` (techniques.compiled_optimizer).

    Each technique's ``apply`` returns a ``Change`` (``techniques._protocol``): the optimizer,
    ``applied``'s notes and rebuilt flag, the hooks the Runner removes and the contexts it
    enters are read off them, in the order they were applied."""
    region = user_region(recipe.instance) if recipe.instance is not None else None
    if region is not None and knobs.optimizer_impl is None:
        knobs = knobs.replace(optimizer_impl="compiled")
    _refuse(knobs, user_step)
    check_knobs(knobs, plan.batch_size)         # optimizer_in_backward's refusals
    # refused before the model is touched (expandable_segments is read when CUDA starts)
    pools, allocator_note = apply_allocator(plan, device_type)
    low_bit = None
    if knobs.optimizer_state not in (None, "fp32"):    # refuses optimizer_impl, non-Adam classes
        low_bit = LowBitOptimizer(LowBitOptimizer.Config(knobs.optimizer_state)) \
            .apply(model, recipe)
        recipe = low_bit.recipe
    elif is_torchao(recipe.instance) or may_make_torchao(recipe):   # traced compiled
        other = BnbRecipe(recipe.spec, recipe.impl) if may_make_bnb(recipe) else None
        recipe = TorchaoRecipe(recipe.spec, recipe.impl, other)
    elif is_bnb(recipe.instance) or may_make_bnb(recipe):   # its args, overrides kept
        recipe = BnbRecipe(recipe.spec, recipe.impl)
    tech = Precision(Precision.Config(knobs.precision or "fp32"), autocast_impl)
    blocks, changes = dict(plan.blocks), []
    try:
        if knobs.quantize_base not in (None, "none"):     # in place; a trace's twin already is
            quantize = QuantizedBase(QuantizedBase.Config(kind=knobs.quantize_base))
            if quantize.pending(model):
                changes.append(quantize.apply(model))
        if knobs.checkpoint not in (None, "none"):
            changes.append(Checkpoint(Checkpoint.Config(knobs.checkpoint),
                                      autocast_factory=_recompute_factory(tech, recompute_context))
                           .apply(model))
            blocks.update(changes[-1].modes)
        if knobs.offload not in (None, "none"):
            # offload's hooks sit outside a checkpoint's: on a block that is also recomputed,
            # what leaves the device is the checkpoint's inputs
            changes.append(Offload(Offload.Config(knobs.offload)).apply(model))
            _merge_offload(blocks, changes[-1].modes)
        if knobs.chunked_loss:       # the loss over pieces of tokens, recomputed in backward
            changes.append(ChunkedLoss(ChunkedLoss.Config(knobs.chunked_loss),
                                       autocast_factory=_recompute_factory(tech,
                                                                           recompute_context))
                           .apply(model))
        if knobs.optimizer_impl is not None:
            recipe = recipe.with_impl(knobs.optimizer_impl)
        if knobs.optimizer_impl == "compiled":
            recipe = CompiledStepRecipe(recipe, region)
        built = tech.apply(model, recipe, origin)
        changes += [built, *_impl_rebuilt(model, knobs, recipe, built.optimizer)]
        changes += [low_bit] if low_bit is not None else []
        if knobs.optimizer_in_backward:    # split per parameter, each stepped by a grad hook
            changes.append(OptimizerInBackward(OptimizerInBackward.Config())
                           .apply(model, built.optimizer))
        if knobs.offload_optimizer:
            changes.append(_offload_optimizer(model, built.optimizer, knobs))
    except BaseException:
        for c in reversed(changes):       # leave the user's model as it was
            c.remove()
        raise
    optimizer = [c.optimizer for c in changes if c.optimizer is not None][-1]
    scaler = None
    if knobs.precision == "fp16":
        scaler = (scaler_class or torch.amp.GradScaler)(device_type)
    if callable(scheduler) and not hasattr(scheduler, "step"):
        # bf16-pure's wrapper is not a torch Optimizer: schedule the one over the masters
        target = optimizer.inner if isinstance(optimizer, MasterWeightsOptimizer) else optimizer
        scheduler = scheduler(target)
    acc = Accumulation(Accumulation.Config(knobs.micro_batch_size), count_fn)
    budget = plan.budget_bytes if budget_bytes is None else budget_bytes
    if knobs.remat:      # DTR around each effective batch, under the budget if any
        changes.append(Remat(Remat.Config(budget_bytes=budget)).apply(model, optimizer))
    contexts = [c.context for c in changes if c.context is not None]
    if pools is not None:
        contexts.append(lambda: pools)            # leaves the last phase's pool after a step
    notes = [*notes, *(n for c in changes for n in c.notes)]
    notes += [allocator_note] if allocator_note else []
    applied = Applied(blocks=blocks, optimizer_rebuilt=any(c.optimizer_rebuilt for c in changes),
                      budget_bytes=budget, notes=notes)
    return Runner(model, optimizer, plan=plan, applied=applied, precision=tech,
                  accumulation=acc, loss_fn=loss_fn, scaler=scaler, scheduler=scheduler,
                  device_type=device_type, handles=changes, contexts=contexts, replan=replan,
                  batch_shapes=None if planned_batch is None else BatchShapes(planned_batch),
                  user_step=user_step, on_phase=None if pools is None else pools.on_phase)


def _refuse(knobs: Knobs, user_step=None) -> None:
    """The combinations no technique runs yet, refused before anything is applied."""
    knobs.check_combinations(user_step is not None)


def _recompute_factory(tech: Precision, recompute_context) -> Callable | None:
    """A real torch.autocast is replayed by checkpoint itself (None); a modelled one must be
    re-entered around the recompute, which runs in backward, outside the mode."""
    if recompute_context is None:
        return None
    return lambda: recompute_context(tech.autocast_dtype)


def _impl_rebuilt(model: nn.Module, knobs: Knobs, recipe: OptimizerRecipe,
                  optimizer) -> list[Change]:
    """The ``Change`` of ``optimizer_impl`` when it rebuilt the user's optimizer instance
    (bf16-pure's own ``Change`` says that it rebuilt it)."""
    if knobs.optimizer_impl is None or recipe.instance is None or \
            optimizer is recipe.instance or knobs.precision == "bf16-pure":
        return []
    flags = ", ".join(f"{k}={v}" for k, v in IMPL_FLAGS[knobs.optimizer_impl].items()) or \
        "its step compiled"
    return [Change(model, optimizer_rebuilt=True,
                   notes=(f"optimizer_impl={knobs.optimizer_impl}: the optimizer was rebuilt "
                          f"with {flags} (runner.optimizer); the one passed in is no longer "
                          "used",))]


def _offload_optimizer(model: nn.Module, optimizer, knobs: Knobs) -> Change:
    """Optimizer offload, or parameter offload, which offloads the optimizer itself (its host
    twins are the offloaded weights)."""
    if knobs.offload_params not in (None, "none"):
        return ParamOffload(ParamOffload.Config(knobs.offload_params)).apply(model, optimizer)
    return OptimizerOffload(OptimizerOffload.Config(
        offload_gradients=bool(knobs.offload_gradients))).apply(model, optimizer)


def _merge_offload(blocks: dict[str, Mode], modes: dict[str, Mode]) -> None:
    """Offload's per-block modes into ``blocks`` (which a checkpoint or planner filled)."""
    for name, mode in modes.items():
        if mode == Mode.OFFLOAD:
            blocks[name] = Mode.parse(blocks.get(name, Mode.KEEP)).with_offload()
        else:
            blocks.setdefault(name, mode)
