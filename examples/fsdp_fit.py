"""Train a tiny Llama with memfit's plan applied on FSDP2, one process per rank, on the CPU.

    torchrun --nproc-per-node 2 examples/fsdp_fit.py                  # FSDP2, your knobs
    torchrun --nproc-per-node 2 examples/fsdp_fit.py --budget 1.5MiB  # memfit plans (rank 0)

Each rank builds the same model (same seed), takes its half of the batch and calls
``memfit.fit(..., gpus=...)`` after ``init_process_group``: with a budget, rank 0 plans in a
child process and every rank applies the same plan (memfit.api._fit_sharded Note 1).
"""

import argparse

import torch
import torch.distributed as dist

import memfit
from memfit import zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", default=None, help="bytes per rank, e.g. 1.5MiB (default: none)")
    ap.add_argument("--sharding", default="fsdp", choices=("fsdp", "ddp"),
                    help="the layout without a budget (default: fsdp)")
    ap.add_argument("--steps", type=int, default=3, help="effective batches to train")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = zoo.get("llama-1b")
    model = spec.build(tiny=True, seed=0)
    batch = spec.make_batch(model, 2 * world, seq_len=16, seed=0)
    mine = {k: v[rank * 2:(rank + 1) * 2] for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    knobs = {"gpus": world} if args.budget else {"gpus": world, "sharding": args.sharding}
    job = memfit.Job(model, mine, optimizer=opt)
    runner = memfit.fit(job, budget=args.budget, device="cpu", **knobs)
    if rank == 0:
        print(runner.plan.explain())
    for step in range(args.steps):
        with memfit.track(runner.model, runner.optimizer) as t:
            loss = runner.step(mine)
        print(f"rank {rank} step {step}: loss {loss:.4f}, peak {memfit.format_bytes(t.peak_bytes)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
