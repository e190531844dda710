"""``memfit.fit(..., gpus=N, sharding=...)`` inside each rank of a ``torchrun`` job: the plan
applied with FSDP2 (``fully_shard`` per block and at the root) or DDP over the job's group.

Note 1 (where the plan is made). The planner traces one rank under a fake process group, and
c10d holds one default group per process (``trace.sharded`` Note 1): inside a running job it
cannot trace. So with a budget, rank 0 plans in a child process (``spawn``: a fresh
interpreter without the job's group) on a ``meta`` copy of the model (no weights are copied)
and the job's effective batch (this rank's batch, ``world`` times: every rank's has the same
shapes), and broadcasts the plan (``broadcast_object_list``); every rank then applies the same
plan. ``loss_fn`` and ``count_fn`` must be picklable (module-level functions) to reach the
child. Without a budget the knobs are the plan.

Note 2 (the optimizer). ``fully_shard`` replaces every parameter by a sharded one, so the
optimizer is rebuilt from the instance's class, hyper-parameters and groups over the new
parameters (``OptimizerRecipe``'s ``origin`` mapping, as ``estimate_sharded`` does); the plan
says so. A scheduler given as an instance would drive the old optimizer: pass a factory.

Note 3 (the OOM guard). Off under more than one rank (``runtime.oom_guard`` Note 4): an
out-of-memory error on one rank leaves the others inside a collective, so ranks cannot agree
on a new plan after the fact; ``runner.applied.notes`` says so, and the error is raised as is.
"""

from __future__ import annotations

import copy
import multiprocessing
import pickle

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from memfit.api._setup import build_runner, resolve_device
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.sharding import Sharding
from memfit.units import parse_bytes

__all__ = ["fit_sharded", "is_sharded"]

_SHARD = ("gpus", "sharding", "reshard_after_forward", "fsdp_offload")


def is_sharded(k: Knobs) -> bool:
    return k.gpus not in (None, 1) or k.sharding not in (None, "none") or \
        k.reshard_after_forward is not None or bool(k.fsdp_offload)


def fit_sharded(model: nn.Module, optimizer, batch, budget, device, loss_fn, k: Knobs, *,
                count_fn=None, scheduler=None):
    """The Runner of one rank (module Notes); ``batch`` is this rank's."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("gpus/sharding in memfit.fit run inside each rank of a job: call "
                         "torch.distributed.init_process_group first (e.g. under torchrun); "
                         "to plan from one process use memfit.plan(..., gpus=N)")
    world = dist.get_world_size()
    if k.gpus not in (None, "auto", world):
        raise ValueError(f"gpus={k.gpus} but this job has {world} ranks: leave gpus unset (or "
                         f"'auto') inside a job, or start {k.gpus} ranks")
    if hasattr(scheduler, "step"):
        raise ValueError("sharding rebuilds the optimizer (Note 2 of memfit.api._fit_sharded): "
                         "pass scheduler=a factory, e.g. lambda opt: StepLR(opt, 10)")
    k = k.replace(gpus=world)
    rank_b = batch_size_of(prepare_batch(batch))
    if budget is not None:
        plan = _plan_on_rank0(model, batch, parse_bytes(budget), optimizer, device, loss_fn,
                              count_fn, k, world, rank_b)
    else:
        if k.sharding in (None, "none"):
            raise ValueError(f"gpus={world} without a budget: say which layout, "
                             "sharding='fsdp' or 'ddp' (or give a budget and memfit picks)")
        spec = resolve_device(model, device)
        plan = Plan(k, device=spec.name, batch_size=rank_b)
    return _apply(model, optimizer, plan, loss_fn, count_fn, scheduler)


def _apply(model, optimizer, plan: Plan, loss_fn, count_fn, scheduler):
    from torch.distributed.device_mesh import init_device_mesh
    pk = plan.knobs
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = Sharding.Config(kind=pk.sharding, reshard_after_forward=True
                             if pk.reshard_after_forward is None else pk.reshard_after_forward,
                             offload=bool(pk.fsdp_offload))
    sharded = Sharding(config).apply(model, mesh)
    rest = Knobs(**{n: v for n, v in pk.to_dict().items() if n not in _SHARD})
    factory = scheduler if callable(scheduler) else None
    return build_runner(sharded, OptimizerRecipe(optimizer), rest, plan=plan, origin=trainable,
                        loss_fn=loss_fn, count_fn=count_fn, scheduler=factory,
                        device_type=device_type,
                        notes=[f"{pk.sharding} over {dist.get_world_size()} ranks: the "
                               "optimizer was rebuilt over the sharded parameters "
                               "(memfit.api._fit_sharded Note 2); OOM guard off (Note 3)"])


def meta_copy(model: nn.Module) -> nn.Module:
    """``model`` with every parameter and buffer on ``meta`` (nothing copied)."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) \
            else meta
    return copy.deepcopy(model, memo)


def _job_batch(batch, world: int, rank_b: int):
    """This rank's batch ``world`` times along the batch dimension (Note 1)."""
    def grow(t):
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rank_b:
            return torch.cat([t] * world)
        return t
    return tree_map(grow, batch)


def _plan_on_rank0(model, batch, budget, optimizer, device, loss_fn, count_fn, k: Knobs,
                   world: int, rank_b: int) -> Plan:
    box = [None]
    if dist.get_rank() == 0:
        knobs = {n: v for n, v in k.to_dict().items() if v is not None}
        opt = optimizer if isinstance(optimizer, str) else _name_of(optimizer)
        payload = pickle.dumps((meta_copy(model), _job_batch(batch, world, rank_b), budget,
                                opt, device, loss_fn, count_fn, knobs))
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            box[0] = pool.apply(_plan_child, (payload,))
    dist.broadcast_object_list(box, src=0)
    kind, text, floor, budget_bytes = box[0]
    if kind == "BudgetTooSmall":          # the same error on every rank
        raise BudgetTooSmall(text, floor_bytes=floor, budget_bytes=budget_bytes)
    if kind != "plan":
        raise ValueError(f"planning on rank 0 failed: {kind}: {text}")
    return Plan.from_json(text)


def _name_of(optimizer) -> str:
    """The planner traces optimizers by name: the instance's class as one (Note 1)."""
    names = {"AdamW": "adamw", "Adam": "adam", "Adagrad": "adagrad", "RMSprop": "rmsprop",
             "SGD": "sgd"}
    name = names.get(type(optimizer).__name__)
    if name is None:
        raise ValueError(f"{type(optimizer).__name__}: planning inside a job traces the "
                         f"optimizer by name; use one of {', '.join(names)}")
    if name == "sgd" and any(g.get("momentum") for g in optimizer.param_groups):
        name = "momentum"
    return name


def _plan_child(payload: bytes):
    from memfit.api.plan import plan
    model, batch, budget, opt, device, loss_fn, count_fn, knobs = pickle.loads(payload)
    try:
        return "plan", plan(model, batch, budget, opt, device, loss_fn, count_fn=count_fn,
                            **knobs).to_json(), None, None
    except Exception as e:     # as plain values (an exception may not unpickle), to every rank
        return (type(e).__name__, str(e), getattr(e, "floor_bytes", None),
                getattr(e, "budget_bytes", None))
