"""The real side of the ``memfit.fit(gpus=2, ...)`` tests: each gloo rank fits its half of the
batch and runs one planned step; rank 0 writes the full parameters after it, and every rank its
``track`` peak (``_worker`` Note 1: FSDP2's reduce-scatter runs in place under gloo)."""

import json
import os

import torch
import torch.distributed as dist

import memfit
from tests.distributed._worker import join, rank_share, reduce_scatter_in_place


def full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def run_rank(rank: int, world_size: int, port: int, job: dict, out_dir: str) -> None:
    join(rank, world_size, port)
    try:
        model, mine = rank_share(job, rank, world_size)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runner = memfit.fit(model, opt, mine, budget=job.get("budget"), **job["knobs"])
        reduce_scatter_in_place(runner.model)
        if "ballast_rank" in job:            # one rank over the budget: every rank must stop
            return _stop_all(rank, runner, mine, job, out_dir)
        with memfit.track(runner.model, runner.optimizer, budget=job.get("budget")) as t:
            loss = runner.step(mine)
        params = {name.removeprefix("module."): full(p).detach().clone()     # DDP's wrapper
                  for name, p in runner.model.named_parameters()}
        if rank == 0:
            torch.save(params, os.path.join(out_dir, "params.pt"))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"peak_bytes": t.peak_bytes, "loss": loss,
                       "knobs": runner.plan.knobs.to_dict()}, f)
    finally:
        dist.destroy_process_group()


def ballast_step(rank, runner, batch, job) -> "memfit.OutOfMemory | None":
    """One step in which rank ``ballast_rank`` holds a budget's worth of extra bytes: the
    ``OutOfMemory`` this rank raised (its traceback dropped), or None."""
    with memfit.track(runner.model, runner.optimizer):
        ballast = torch.empty(job["budget"] // 4 if rank == job["ballast_rank"] else 0)
        try:
            runner.step(batch)
        except memfit.OutOfMemory as e:
            return e.with_traceback(None)
        finally:
            del ballast
    return None


def _stop_all(rank, runner, batch, job, out_dir):
    e = ballast_step(rank, runner, batch, job)
    error = None if e is None else {"op": e.op, "notes": list(getattr(e, "__notes__", []))}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error}, f)
