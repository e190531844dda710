"""The real side of the OOM-guard-across-ranks tests (``test_oom_ranks``): each gloo rank fits
its share of the batch with ``memfit.fit(gpus=N, sharding=...)`` and steps under ``track``;
one rank is made to run out of memory, and every rank writes what it saw.

Jobs (``job["case"]``):
  "recover": rank ``stale_rank``'s plan predicts an optimizer step of a whole budget (a stale
    plan), so its Note 6 check crosses the budget and every rank must re-plan together;
    every rank then trains ``steps`` steps, and rank 0 writes the full parameters.
  "agree": as "recover" without a budget (no planning child): the runner holds ``budget``
    and a hand-made collective re-planner (checkpoint="all", the real step bytes), so the
    agreement, the restore and the adoption on every rank are what is tested.
  "ballast": rank ``ballast_rank`` holds a budget's worth of extra bytes through the step:
    the re-plan cannot fit, and every rank must raise the same error, parameters intact.
  "forward": rank ``oom_rank`` steps under ``track(budget=...)`` too small for its forward,
    the others under no budget: every rank must stop with one error naming that rank.
"""

import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

import memfit
from tests.distributed._fit_worker import ballast_step, full
from tests.distributed._worker import join, rank_share, reduce_scatter_in_place


def local(model) -> list[torch.Tensor]:
    """This rank's parameter bytes (FSDP2: its shards), copied."""
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for p in model.parameters()]


def error_record(e: BaseException) -> dict:
    return {"type": type(e).__name__, "op": getattr(e, "op", None),
            "numbers": [getattr(e, n, None) for n in ("requested_bytes", "live_bytes",
                                                      "budget_bytes")],
            "message": str(e), "notes": list(getattr(e, "__notes__", [])),
            "failed_ranks": getattr(e, "failed_ranks", None),
            "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None}


def run_rank(rank: int, world_size: int, port: int, job: dict, out_dir: str) -> None:
    join(rank, world_size, port)
    out = {}
    try:
        model, mine = rank_share(job, rank, world_size)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        budget = job.get("budget") if job["case"] != "agree" else None
        runner = memfit.fit(model, opt, mine, budget=budget, **job["knobs"])
        reduce_scatter_in_place(runner.model)
        out = {"first_knobs": runner.plan.knobs.to_dict(), "notes": list(runner.applied.notes)}
        before = local(runner.model)
        out.update(_CASES[job["case"]](rank, runner, mine, job))
        out["unchanged"] = all(torch.equal(a, b) for a, b in
                               zip(before, local(runner.model), strict=True))
        if job["case"] in ("recover", "agree"):
            params = {name.removeprefix("module."): full(p).detach().clone()
                      for name, p in runner.model.named_parameters()}
            if rank == 0:
                torch.save(params, os.path.join(out_dir, "params.pt"))
        out["initialized_after"] = dist.is_initialized()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        if dist.is_initialized():              # a stop destroys it (oom_ranks Note 3)
            dist.destroy_process_group()


def _recover(rank, runner, batch, job):
    if rank == job["stale_rank"]:
        runner.plan = dataclasses.replace(runner.plan,
                                          predicted_optimizer_step_bytes=job["budget"])
    losses = []
    with memfit.track(runner.model, runner.optimizer):
        for _ in range(job["steps"]):
            losses.append(runner.step(batch))
    return {"losses": losses, "knobs": runner.plan.knobs.to_dict(),
            "applied_notes": list(runner.applied.notes)}


def _agree(rank, runner, batch, job):
    from memfit.api._setup import build_runner
    from memfit.knobs import Knobs
    from memfit.optimizers import OptimizerRecipe
    from memfit.planner import Plan
    from memfit.runtime.oom_guard import OomGuard
    budget, calls = job["budget"], []

    def replan(excess):
        calls.append(excess)
        k = Knobs(checkpoint="all")
        plan = Plan(k.replace(gpus=2, sharding="fsdp"), budget_bytes=budget,
                    predicted_optimizer_step_bytes=0)
        return build_runner(runner.model, OptimizerRecipe(runner.optimizer), k, plan=plan,
                            device_type="cpu", budget_bytes=budget,
                            notes=["re-planned on every rank (hand-made)"])
    replan.collective = True
    runner.guard = OomGuard(replan, distributed=True)
    runner.applied = dataclasses.replace(runner.applied, budget_bytes=budget)
    # every rank runs the check (a plan without step bytes skips it, and its all_reduce)
    runner.plan = dataclasses.replace(runner.plan, predicted_optimizer_step_bytes=0)
    out = _recover(rank, runner, batch, job)
    out["calls"] = calls
    return out


def _ballast(rank, runner, batch, job):
    e = ballast_step(rank, runner, batch, job)
    return {"error": None if e is None else error_record(e), "plan_kept": runner.plan.knobs.to_dict(),
            "grads_none": all(p.grad is None for p in runner.model.parameters())}


def _forward(rank, runner, batch, job):
    error, t0 = None, time.monotonic()
    budget = job["track_budget"] if rank == job["oom_rank"] else None
    with memfit.track(runner.model, runner.optimizer, budget=budget):
        try:
            runner.step(batch)
        except torch.OutOfMemoryError as e:
            error = error_record(e)
    return {"error": error, "seconds": time.monotonic() - t0,
            "grads_none": all(p.grad is None for p in runner.model.parameters())}


_CASES = {"recover": _recover, "agree": _agree, "ballast": _ballast, "forward": _forward}
