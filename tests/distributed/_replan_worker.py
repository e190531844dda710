"""The real side of ``test_replan_failure``: each gloo rank fits its share of the batch with
``memfit.fit(gpus=2, sharding='fsdp', budget=...)`` and takes one step (SGD with momentum:
optimizer state to keep); rank ``stale_rank``'s plan then predicts an optimizer step of a whole budget (as ``_oom_ranks_worker``'s "recover"), so the first step's
check crosses the budget on that rank and every rank re-plans together (``_fit_sharded``
Note 3), and the re-plan is made to fail. Every surviving rank writes what it saw.

Jobs (``job["case"]``):
  "rank0": rank 0's planning fails once per step, as ``job["failures"]`` says: "killed", its
    child is killed (SIGKILL, as the host's out-of-memory killer would) as it unpickles the
    job; "unpicklable", its ``loss_fn`` does not pickle (a lambda). Each step must raise the
    same error on both ranks.
  "fit_lambda": ``loss_fn`` is a lambda from the start: rank 0 cannot send the first plan's
    job to its child, and ``memfit.fit`` must raise the same error on both ranks.
  "peer_dies": rank ``victim`` kills itself (SIGKILL) as it enters the re-plan; the other
    rank must raise memfit's error within seconds.
"""

import dataclasses
import json
import os
import signal
import time

import torch
import torch.distributed as dist

import memfit
from memfit.runtime.replan_broadcast import ReplanError
from tests.distributed._oom_ranks_worker import error_record, local
from tests.distributed._worker import join, rank_share, reduce_scatter_in_place


def _sigkill_self():
    os.kill(os.getpid(), signal.SIGKILL)


class KilledWhenUnpickled:
    """A ``loss_fn`` stand-in whose unpickling kills the process unpickling it."""

    def __reduce__(self):
        return _sigkill_self, ()


def _loss_fn(job):
    return (lambda model, batch: model(**batch).loss) if job["case"] == "fit_lambda" else None


def run_rank(rank: int, world_size: int, port: int, job: dict, out_dir: str) -> None:
    join(rank, world_size, port)
    out = {}
    try:
        model, mine = rank_share(job, rank, world_size)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        t0 = time.monotonic()
        try:
            runner = memfit.fit(model, opt, mine, budget=job["budget"], gpus=2,
                                sharding="fsdp", device="cpu", loss_fn=_loss_fn(job))
        except ReplanError as e:           # "fit_lambda": the first plan
            out.update(fit_error=error_record(e), seconds=time.monotonic() - t0)
            return
        reduce_scatter_in_place(runner.model)
        runner.step(mine)              # momentum buffers: optimizer state to keep
        if rank == job["stale_rank"]:
            runner.plan = dataclasses.replace(runner.plan,
                                              predicted_optimizer_step_bytes=job["budget"])
        out["first_knobs"] = runner.plan.knobs.to_dict()
        out["fit_seconds"] = time.monotonic() - t0
        out.update(_CASES[job["case"]](rank, runner, mine, job))
        out["plan_kept"] = runner.plan.knobs.to_dict()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized() and job["case"] != "peer_dies":
            dist.destroy_process_group()


def _step(runner, batch) -> dict:
    """One step that must fail: its error, seconds, and whether this rank's parameter bytes
    and optimizer state stayed as they were."""
    before = local(runner.model)
    state = _state(runner.optimizer)
    error, t0 = None, time.monotonic()
    with memfit.track(runner.model, runner.optimizer):
        try:
            runner.step(batch)
        except Exception as e:
            error = error_record(e)
            error["cause_message"] = str(e.__cause__) if e.__cause__ is not None else None
    return {"error": error, "seconds": time.monotonic() - t0, "state_tensors": len(state),
            "unchanged": all(torch.equal(a, b) for a, b in
                             zip(before, local(runner.model), strict=True)),
            "state_unchanged": all(torch.equal(a, b) for a, b in
                                   zip(state, _state(runner.optimizer), strict=True)),
            "grads_none": all(p.grad is None for p in runner.model.parameters())}


def _state(optimizer) -> list[torch.Tensor]:
    """This rank's optimizer state tensors (FSDP2: its shards), copied."""
    return [(v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def _rank0(rank, runner, batch, job):
    steps = []
    for failure in job["failures"]:
        if rank == 0:
            runner.guard.replan.job.loss_fn = KilledWhenUnpickled() if failure == "killed" \
                else lambda out, b: out.loss
        steps.append(_step(runner, batch))
    return {"steps": steps, "initialized_after": dist.is_initialized()}


def _peer_dies(rank, runner, batch, job):
    if rank == job["victim"]:
        runner.guard.replan.job.plan = lambda *args: _sigkill_self()
    return {"steps": [_step(runner, batch)]}


_CASES = {"rank0": _rank0, "peer_dies": _peer_dies}
