"""Worker for the 2-process gloo test of the OOM guard (spawned; importable by path)."""

import os

import torch
import torch.distributed as dist

import memfit
from tests.helpers import tiny


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    from tests.runtime.test_oom_guard import guarded, inject_oom, replanner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, batch = tiny("gpt2", batch_size=4, seq_len=12)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
        calls = []
        runner = guarded(memfit.fit(ddp, opt, batch, micro_batch_size=2),
                         replanner(memfit.fit(ddp, opt, batch), calls=calls))
        inject_oom(model.transformer.h[1], on_calls={1})    # on every rank: no one hangs
        result = {"reasons": list(runner.applied.notes)}
        try:
            runner.step(batch)
        except torch.OutOfMemoryError as e:
            result["error"] = type(e).__name__
            result["notes"] = list(getattr(e, "__notes__", []))
        result["replans"] = len(calls)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
