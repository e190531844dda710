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
    its buckets at step 2, ``api._rank_layout`` Note 4)."""
    sharded = Sharding(config).apply(model, mesh).model
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


def _live_bytes(tensors) -> int:
    """The bytes of the distinct storages behind ``tensors`` (DTensors by their local shard),
    by address: an oracle that shares nothing with ``track``."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def user_sharded_rank(rank: int, world_size: int, port: int, arch: str, out_dir: str) -> None:
    """The user's own FSDP2 job, not memfit's Runner: ``fully_shard`` on each decoder layer and
    the root, gloo's own reduce-scatter (its full-size copy, memfit.measure._collectives Note 1),
    AdamW, the canonical step. Two steps, then step 3 under ``track(model, optimizer)`` and
    step 4 under ``track()``; beside them, the bytes of the parameters' shards, of the
    optimizer state and of the batch, counted apart (``_live_bytes``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils._pytree import tree_flatten

    from tests.helpers import tiny
    join(rank, world_size, port)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        model, batch = tiny(arch)
        batch = prepare_batch(batch)   # the batch estimate_sharded traces (no all-ones mask)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            opt.step()

        step()
        step()
        with memfit.track(model, opt) as given:
            step()
        with memfit.track() as bare:
            step()
        state = [v for s in opt.state.values() for v in tree_flatten(s)[0]]
        out = {"given": [given.peak_bytes, given.breakdown], "bare": [bare.peak_bytes, bare.breakdown],
               "params": _live_bytes(model.parameters()), "buffers": _live_bytes(model.buffers()),
               "state": _live_bytes(state), "batch": _live_bytes(batch.values())}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()
