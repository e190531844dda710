"""``memfit.fit(..., gpus=N, sharding=...)`` inside each rank of a ``torchrun`` job: the plan
applied with FSDP2 (``fully_shard`` per block and at the root) or DDP over the job's group.

Note 1 (where the plan is made). The planner traces one rank under a fake process group, and
c10d holds one default group per process (``trace.sharded``): inside a running job it
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

Note 3 (the OOM guard). With a budget the Runner's re-planner is collective
(``runtime.oom_guard``): when the optimizer-step check finds any rank over its budget, every rank
calls it with the worst rank's excess; the budget is lowered by every excess so far (plus the
single-device guard's margin), rank 0 plans again as in Note 1 (child process, broadcast), the
layout (``gpus``, ``sharding``, ``fsdp_offload``), precision and optimizer placement kept, and every
rank builds the same new plan over the same sharded model and optimizer: the per-block modes and
micro-batch are re-applied, FSDP2's ``reshard_after_forward`` set with
``set_reshard_after_forward``. When nothing fits, every rank raises the same ``BudgetTooSmall`` and
the guard's own error (``runtime.oom_guard``). An out-of-memory error inside one rank's forward or
backward stops every rank with that rank's error, with or without a budget (``runtime.oom_ranks``).

Note 4 (a re-plan that fails on the way). Rank 0 always broadcasts a result: a failure before
the child answers (``loss_fn`` that does not pickle, a child that dies or is killed, one that
cannot start) is sent as one, and every rank raises the same ``ReplanError`` naming rank 0's
failure, its type and text, and the fix; at a re-plan the guard then restores and raises its
own error on every rank (``runtime.oom_guard``), parameters and optimizer state unchanged.
The child is a ``spawn``-ed ``Process`` answering over a pipe rather than a ``Pool``: a pool
whose worker is killed waits for its answer for ever, while the pipe reads end-of-file when
the child exits (a child that hangs keeps rank 0, and the others with it, waiting up to the
group's timeout). A rank that fails while the plan is shared (a peer died: gloo's "Connection
closed by peer") raises ``ReplanError`` naming the rank it waited on and shuts its connections,
so that no rank waits for the group's timeout (``runtime.replan_broadcast``).
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
from memfit.runtime.oom_guard import replan_shortfall
from memfit.runtime.replan_broadcast import ReplanError, share_from_rank0
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.sharding import Sharding
from memfit.units import format_bytes, parse_bytes
from memfit.api.plan import plan

__all__ = ["fit_sharded", "is_sharded"]

_SHARD = ("gpus", "sharding", "reshard_after_forward", "fsdp_offload", "mp_policy")


def is_sharded(k: Knobs) -> bool:
    return k.gpus not in (None, 1) or k.sharding not in (None, "none") or \
        k.reshard_after_forward is not None or bool(k.fsdp_offload) or k.mp_policy is not None


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
    replan = None
    if budget is not None:
        budget = parse_bytes(budget)
        job = _Job(meta_copy(model), batch, optimizer if isinstance(optimizer, str)
                   else _name_of(optimizer), device, loss_fn, count_fn, world, rank_b)
        plan = job.plan(budget, k)
        replan = _Replanner(job, budget, k, plan)
    else:
        if k.sharding in (None, "none"):
            raise ValueError(f"gpus={world} without a budget: say which layout, "
                             "sharding='fsdp' or 'ddp' (or give a budget and memfit picks)")
        spec = resolve_device(model, device)
        plan = Plan(k, device=spec.name, batch_size=rank_b)
    return _apply(model, optimizer, plan, loss_fn, count_fn, scheduler, replan)


def _apply(model, optimizer, plan: Plan, loss_fn, count_fn, scheduler, replan=None):
    from torch.distributed.device_mesh import init_device_mesh
    pk = plan.knobs
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = Sharding.Config(kind=pk.sharding, reshard_after_forward=True
                             if pk.reshard_after_forward is None else pk.reshard_after_forward,
                             offload=bool(pk.fsdp_offload), mp_policy=pk.mp_policy)
    sharded = Sharding(config).apply(model, mesh).model
    rest = Knobs(**{n: v for n, v in pk.to_dict().items() if n not in _SHARD})
    factory = scheduler if callable(scheduler) else None
    guard = ("OOM guard: ranks agree on a new plan at the optimizer step, and an "
             "out-of-memory error elsewhere stops every rank with one error (Note 3)"
             if replan is not None else "no budget, so no re-plan: an out-of-memory error "
             "stops every rank with one error (Note 3)")
    runner = build_runner(sharded, OptimizerRecipe(optimizer), rest, plan=plan,
                          origin=trainable, loss_fn=loss_fn, count_fn=count_fn,
                          scheduler=factory, device_type=device_type, replan=replan,
                          notes=[f"{pk.sharding} over {dist.get_world_size()} ranks: the "
                                 "optimizer was rebuilt over the sharded parameters "
                                 f"(memfit.api._fit_sharded Note 2); {guard}"])
    if replan is not None:
        replan.runner = runner
    return runner


class _Replanner:
    """The OOM guard's collective ``replan(excess)`` (Note 3): called on every rank with the
    same excess, it plans on rank 0 under the budget lowered by every excess so far (the layout,
    precision and optimizer kept) and applies the same plan on every rank."""

    collective = True          # oom_guard: one plan for all ranks

    def __init__(self, job: "_Job", budget: int, k: Knobs, first: Plan):
        fk = first.knobs
        self.job, self.budget, self.missing = job, budget, 0
        self.fixed = k.replace(sharding=fk.sharding, fsdp_offload=fk.fsdp_offload,
                               mp_policy=fk.mp_policy,
                               precision=fk.precision or "fp32",
                               optimizer_impl=fk.optimizer_impl,
                               offload_optimizer=fk.offload_optimizer)
        self.runner = None         # set once built: its model, optimizer and loss

    def __call__(self, excess: int):
        # the same numbers on every rank: the same error on each
        self.missing = replan_shortfall(self.missing, excess, self.budget, ", on the worst rank")
        left = self.budget - self.missing
        plan = self.job.plan(left, self.fixed)       # a collective: every rank gets it
        pk, r = plan.knobs, self.runner
        model = r.model
        rest = Knobs(**{n: v for n, v in pk.to_dict().items() if n not in _SHARD})
        new = build_runner(model, OptimizerRecipe(r.optimizer), rest, plan=plan,
                            loss_fn=r.loss_fn, count_fn=r.accumulation.count_fn,
                            device_type=r.device_type, budget_bytes=self.budget,
                            notes=[f"re-planned on every rank after running out of memory: "
                                   f"planned on rank 0 under {format_bytes(left)}, "
                                   f"{format_bytes(self.missing)} below the "
                                   f"{format_bytes(self.budget)} budget"])
        if pk.sharding == "fsdp" and hasattr(model, "set_reshard_after_forward"):
            model.set_reshard_after_forward(True if pk.reshard_after_forward is None
                                            else pk.reshard_after_forward)
        return new


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


class _Job:
    """What rank 0 plans for, at the start and at each re-plan (Note 1)."""

    def __init__(self, meta, batch, optimizer: str, device, loss_fn, count_fn, world: int,
                 rank_b: int):
        self.meta, self.batch, self.optimizer, self.device = meta, batch, optimizer, device
        self.loss_fn, self.count_fn, self.world, self.rank_b = loss_fn, count_fn, world, rank_b

    def plan(self, budget: int, k: Knobs) -> Plan:
        """The plan for ``budget``, made on rank 0 and broadcast: a collective (Note 4)."""
        kind, text, floor, budget_bytes = share_from_rank0(lambda: self._plan_here(budget, k))
        if kind == "BudgetTooSmall":          # the same error on every rank
            raise BudgetTooSmall(text, floor_bytes=floor, budget_bytes=budget_bytes)
        if kind == _RANK0_FAILED:
            raise ReplanError(text)
        if kind != "plan":
            raise ValueError(f"planning on rank 0 failed: {kind}: {text}")
        return Plan.from_json(text)

    def _plan_here(self, budget: int, k: Knobs) -> tuple:
        """Rank 0: ``_plan_child``'s result from a spawned process (Note 1); whatever fails
        on the way is a result too (Note 4), so that rank 0 always has one to broadcast."""
        knobs = {n: v for n, v in k.to_dict().items() if v is not None}
        try:
            payload = pickle.dumps((self.meta, _job_batch(self.batch, self.world, self.rank_b),
                                    budget, self.optimizer, self.device, self.loss_fn,
                                    self.count_fn, knobs))
        except Exception as e:        # not swallowed: every rank raises it (Note 4)
            return _rank0_failed("pickling the planning job for the child process", e,
                                 "loss_fn and count_fn must be picklable: module-level "
                                 "functions, not lambdas or closures (Note 1)")
        return _in_child(payload)


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


_RANK0_FAILED = "memfit: rank 0 could not plan"      # a result's kind (Note 4)


def _in_child(payload: bytes) -> tuple:
    """``_plan_child(payload)`` in a spawned process, or the failure that stopped it (Note 4:
    a pipe, not a Pool, so that a child that dies is seen)."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(payload, send), daemon=True)
    try:
        child.start()
        send.close()              # the child holds the only writer: its exit is EOF here
        return recv.recv()
    except EOFError:
        child.join()
        return _rank0_failed("the planning child process", None,
                             f"it exited with code {child.exitcode} before answering (a "
                             "negative code is the signal that killed it, e.g. -9 from the "
                             "host's out-of-memory killer): check rank 0's log and the host's "
                             "free memory, then run again")
    except Exception as e:
        return _rank0_failed("starting or reading the planning child process", e,
                             "check rank 0's log, then run again")
    finally:
        recv.close()
        if child.is_alive():
            child.kill()
        if child.pid is not None:
            child.join()


def _rank0_failed(what: str, e: BaseException | None, fix: str) -> tuple:
    error = f"{type(e).__name__}: {e}; " if e is not None else ""
    return (_RANK0_FAILED, f"memfit: planning on rank 0 failed before it made a plan, at "
            f"{what}: {error}{fix}. Every rank raises this error; no plan changed "
            "(memfit.api._fit_sharded Note 4)", None, None)


def _child_main(payload: bytes, send) -> None:
    send.send(_plan_child(payload))


def _plan_child(payload: bytes):
    try:
        model, batch, budget, opt, device, loss_fn, count_fn, knobs = pickle.loads(payload)
    except Exception as e:        # e.g. a loss_fn defined in an interactive __main__
        return _rank0_failed("unpickling the planning job in the child process", e,
                             "loss_fn and count_fn must be importable in a fresh interpreter: "
                             "define them in a module (Note 1)")
    try:
        return "plan", plan(model, batch, budget, opt, device, loss_fn, count_fn=count_fn,
                            **knobs).to_json(), None, None
    except Exception as e:     # as plain values (an exception may not unpickle), to every rank
        return (type(e).__name__, str(e), getattr(e, "floor_bytes", None),
                getattr(e, "budget_bytes", None))
