"""estimate_sharded equals each rank of a real gloo job to the byte (peak and breakdown).

The oracle: N real processes (``torch.multiprocessing.spawn``, gloo on the CPU) shard the
same tiny model with the same ``techniques.sharding`` settings, run memfit's Runner for two
steps and measure the third with ``memfit.track`` (``_worker``; its Note 1 says why FSDP2's
reduce-scatter runs in place there). The estimate traces one rank in this process under a
fake process group. Every rank must equal the estimate of that rank (``rank=``): peak bytes
and the breakdown at the peak, exactly; rank 0, the default, holds the most. One real job runs
all the cases of a tier (a spawn costs ~10 s of imports on this machine); each case is its own
test.
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

# default tier: every architecture, each setting at least once, on 2 ranks (one real job of
# 4 cases: ~40 s on an idle 2-core machine, minutes when it is shared)
DEFAULT = [("gpt2", fsdp(True, None)), ("gpt2", DDP), ("llama-1b", fsdp(False, "bf16")),
           ("bert-base", fsdp(True, "bf16"))]
OFFLOAD = {**fsdp(True, None), "offload": True}
# memfit's own knobs under sharding: recompute every block, two micro-batches (DDP all-reduces on
# the last only, FSDP2 reduce-scatters each), clipping (a DTensor norm under FSDP2)
KNOBS = {"checkpoint": "all", "micro_batch_size": 2, "max_grad_norm": 1.0}
SLOW = {2: [(a, c) for a in ARCHS for c in GRID] + [("gpt2", OFFLOAD), ("gpt2", fsdp(), KNOBS),
                                                   ("llama-1b", DDP, KNOBS)],
        4: [(a, c) for a in ARCHS for c in GRID] + [("gpt2", fsdp(2, None)),
                                                   ("llama-1b", fsdp(2, "bf16"))]}


def _name(case):
    arch, c, *knobs = case
    extra = "".join(f"-{k}={v}" for k, v in (knobs[0] if knobs else {}).items())
    if c["kind"] == "ddp":
        return f"{arch}-ddp{extra}"
    return (f"{arch}-reshard{c['reshard_after_forward']}-{c['mp_policy'] or 'fp32'}"
            + ("-offload" if c.get("offload") else "") + extra)


_real: dict = {}


def real(world_size: int, cases: list) -> list[list[dict]]:
    key = (world_size, tuple(map(_name, cases)))
    if key not in _real:
        _real[key] = real_ranks(world_size, [(a, c, k[0] if k else {}, "adamw")
                                             for a, c, *k in cases])
    return _real[key]


def check(world_size: int, cases: list, case, every_rank: bool = False):
    """``every_rank``: trace each rank; else only those measured unlike rank 0's estimate."""
    measured = real(world_size, cases)
    i = cases.index(case)
    arch, c, *knobs = case
    model, batch = tiny(arch)

    def estimate(rank):
        est = estimate_sharded(model, batch, "adamw", device="cpu", world_size=world_size,
                               sharding=c["kind"],
                               reshard_after_forward=c.get("reshard_after_forward", True),
                               mp_policy=c.get("mp_policy"), fsdp_offload=c.get("offload", False),
                               rank=rank, **(knobs[0] if knobs else {}))
        assert not dist.is_initialized()                 # the fake group is gone
        return est.peak_bytes, est.breakdown

    first = estimate(0)
    for rank in range(world_size):
        got = measured[rank][i]["peak_bytes"], measured[rank][i]["breakdown"]
        # a rank that holds less (uneven chunks, trace.sharded Note 1) is traced as itself
        expected = first if rank == 0 or (got == first and not every_rank) else estimate(rank)
        assert got == expected, f"{_name(case)} rank {rank}"
        assert got[0] <= first[0]                      # rank 0 holds the most


@pytest.mark.slow
@pytest.mark.parametrize("case", DEFAULT, ids=map(_name, DEFAULT))
def test_two_ranks(case):
    check(2, DEFAULT, case)


@pytest.mark.slow
@pytest.mark.parametrize("world_size,case",
                         [(w, c) for w, cs in SLOW.items() for c in cs],
                         ids=[f"{w}-{_name(c)}" for w, cs in SLOW.items() for c in cs])
def test_grid(world_size, case):
    """3 architectures x reshard True/False x fp32/bf16 policy, and DDP, on 2 and 4 ranks;
    on 4, reshard_after_forward=2 too; on 2, FSDP2's CPU offload (exact on a CPU target, where
    it moves nothing)."""
    check(world_size, SLOW[world_size], case, every_rank=True)
