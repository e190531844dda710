import json
import os
import socket
import tempfile

import torch.multiprocessing as mp

from tests.distributed._worker import run_rank


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_ranks(world_size: int, jobs: list) -> list[list[dict]]:
    """Run ``jobs`` in a real ``world_size``-process gloo job; per rank, per job, what
    ``track`` measured."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(run_rank, args=(world_size, free_port(), jobs, d), nprocs=world_size)
        out = []
        for r in range(world_size):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                out.append(json.load(f))
    return out
