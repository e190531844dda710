"""The real side of the sharded tests: N gloo processes on the CPU run memfit's Runner on a
model sharded by ``techniques.sharding`` and measure each rank's second step with ``track``.

Note 1 (gloo's reduce-scatter). ``ProcessGroupGloo``'s ``reduce_scatter_tensor`` works on a
full-size copy of its input that it allocates on gloo's worker thread, where no dispatch mode
runs: ``track`` first sees that copy when ``work.wait()`` hands it back on the main thread,
and counts it as a storage alive since the region's start (one unsharded-size buffer per
parameter group: +465,920 B on tiny gpt2, all of it inside the ledger's starting bytes). NCCL
has no such tensor (its scratch lies outside the caching allocator), and nothing in one
process can see gloo's thread. So the real runs reduce-scatter through
``InPlaceReduceScatter``: an in-place ``all_reduce`` of FSDP2's own reduce-scatter input (gloo
reduces dense CPU tensors in place, allocating no tensor) and a copy of this rank's chunk into
FSDP2's own output. The tensors FSDP2 allocates, their sizes and lifetimes are the default
collective's; the values are the same sum (gloo has no AVG: FSDP2 divides before and after
with SUM either way). Only the op log differs (``allreduce_`` + ``copy_`` for
``_reduce_scatter_base_``), so the tests compare peaks and breakdowns, not op-by-op timelines.
"""

import json
import os

import torch
import torch.distributed as dist

import memfit
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.step import prepare_batch
from memfit.techniques.sharding import Sharding
from memfit.api._setup import build_runner


def in_place_reduce_scatter():
    """FSDP2's reduce-scatter as an in-place all-reduce plus copy-out (Note 1)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class InPlaceReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            dist.all_reduce(input_tensor, op=op, group=group)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
            return None

    return InPlaceReduceScatter()


def join(rank: int, world_size: int, port: int) -> None:
    """This process joins the job as ``rank`` of ``world_size`` (gloo, one intra-op thread)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def rank_share(job: dict, rank: int, world_size: int):
    """The tiny ``job["arch"]`` model and this rank's share of its ``job["batch"]`` samples."""
    from tests.helpers import tiny
    model, batch = tiny(job["arch"], batch_size=job["batch"])
    n = job["batch"] // world_size
    return model, {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def reduce_scatter_in_place(model) -> None:
    """Every FSDP2 module of ``model`` reduce-scatters through ``InPlaceReduceScatter`` (Note 1)."""
    for m in model.modules():
        if hasattr(m, "set_custom_reduce_scatter"):
            m.set_custom_reduce_scatter(in_place_reduce_scatter())


def measure(model, batch, optimizer, config: Sharding.Config, mesh, knobs: dict) -> dict:
    """Shard ``model``, run two steps, then measure the next: the steady state (DDP rebuilds
    its buckets at step 2, ``api._sharded`` Note 4)."""
    sharded = Sharding(config).apply(model, mesh)
    if config.kind == "fsdp":
        comm = in_place_reduce_scatter()
        for m in sharded.modules():
            if hasattr(m, "set_custom_reduce_scatter"):
                m.set_custom_reduce_scatter(comm)
    k = Knobs.from_kwargs(**knobs)
    runner = build_runner(sharded, OptimizerRecipe(optimizer), k, plan=Plan(k))
    batch = runner.prepare(prepare_batch(batch))
    runner.run(batch)
    runner.run(batch)
    with memfit.track(runner.model, runner.optimizer) as t:
        runner.run(batch)
    return {"peak_bytes": t.peak_bytes, "breakdown": t.breakdown, "num_ops": t.ops}


def run_rank(rank: int, world_size: int, port: int, jobs: list, out_dir: str) -> None:
    """One rank: every job ``(arch, config kwargs, knobs, optimizer)`` in turn; writes
    ``out_dir/rank{rank}.json``."""
    from tests.helpers import tiny
    from torch.distributed.device_mesh import init_device_mesh
    join(rank, world_size, port)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        out = []
        for arch, config, knobs, optimizer in jobs:
            model, batch = tiny(arch)
            out.append(measure(model, batch, optimizer, Sharding.Config(**config), mesh, knobs))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()
