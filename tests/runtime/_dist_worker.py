"""Worker for the 2-process gloo tests (spawned; importable by path)."""

import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils._python_dispatch import TorchDispatchMode

import memfit
from tests.helpers import tiny


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives dispatched while active, by name."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func._overloadpacket)
        if name.startswith("c10d."):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def run(rank: int, world: int, mode: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, batch = tiny("gpt2", batch_size=8, seq_len=12, padded=True)
        model.eval()                       # no dropout: ranks and micro-batches draw other masks
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        shard = {k: v[rank * 4:(rank + 1) * 4] for k, v in batch.items()}
        result = {}
        if mode == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1000)
            calls = []

            def count_hook(state, bucket):
                calls.append(bucket.index())
                return default_hooks.allreduce_hook(None, bucket)

            wrapped.register_comm_hook(None, count_hook)
            opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
            runner = memfit.fit(wrapped, opt, shard, micro_batch_size=2)
            runner.step(shard)
            result["grad_allreduces"] = len(calls)
            after = {n: p.detach() for n, p in model.named_parameters()}
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.transformer.h:
                fully_shard(block)
            fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            runner = memfit.fit(model, opt, shard, micro_batch_size=2)
            with CollectiveCounter() as counter:
                runner.step(shard)
            result["collectives"] = counter.counts
            after = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        result["updates"] = {n: after[n] - before[n] for n in before}
        result["loss"] = runner.last_step.loss
        result["items"] = runner.last_step.items
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
