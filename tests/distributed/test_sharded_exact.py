"""estimate_sharded equals each rank of a real gloo job to the byte (peak and breakdown).

The oracle: N real processes (``torch.multiprocessing.spawn``, gloo on the CPU) shard the
same tiny model with the same ``techniques.sharding`` settings, run memfit's Runner for one
step and measure the next with ``memfit.track`` (``_worker``; its Note 1 says why FSDP2's
reduce-scatter runs in place there). The estimate traces one rank in this process under a
fake process group. Every rank must equal the estimate: peak bytes and the breakdown at the
peak, exactly.
"""

import itertools

import pytest
import torch.distributed as dist

from memfit.api._sharded import estimate_sharded
from tests.distributed.conftest import real_ranks
from tests.helpers import tiny

ARCHS = ["gpt2", "llama-1b", "bert-base"]


def fsdp(reshard=True, mp=None):
    return {"kind": "fsdp", "reshard_after_forward": reshard, "mp_policy": mp}


DDP = {"kind": "ddp"}
GRID = [fsdp(r, mp) for r, mp in itertools.product([True, False], [None, "bf16"])] + [DDP]


def check(arch: str, world_size: int, configs: list[dict], knobs: dict | None = None,
          optimizer: str = "adamw"):
    knobs = knobs or {}
    real = real_ranks(world_size, [(arch, c, knobs, optimizer) for c in configs])
    for i, c in enumerate(configs):
        model, batch = tiny(arch)
        est = estimate_sharded(model, batch, optimizer, device="cpu", world_size=world_size,
                               sharding=c["kind"],
                               reshard_after_forward=c.get("reshard_after_forward", True),
                               mp_policy=c.get("mp_policy"), **knobs)
        assert not dist.is_initialized()             # the fake group is gone
        for rank in range(world_size):
            got = real[rank][i]
            assert (got["peak_bytes"], got["breakdown"]) == (est.peak_bytes, est.breakdown), \
                f"{arch} {c} rank {rank}"


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_representative(arch):
    """Default tier: per architecture, FSDP2 fp32 resharding, FSDP2 bf16 kept unsharded, DDP."""
    check(arch, 2, [fsdp(True, None), fsdp(False, "bf16"), DDP])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_grid(arch, world_size):
    """Slow tier: reshard True/False x fp32/bf16 policy, and DDP, on 2 and 4 ranks."""
    check(arch, world_size, GRID)
