"""FSDP2's CPU offload for a GPU target (``memfit.trace.fsdp_offload``): the sharded state is
host memory, each all-gather reads device copies of the host shards, and the planner weighs
offload where it fits fewer bytes. The oracle is FSDP2's sharding rule (every shard padded to
``ceil(rows / world)`` rows), computed from the shapes alone."""

import math
from collections import Counter

import pytest

import memfit
from memfit.api._sharded import estimate_sharded
from memfit.errors import BudgetTooSmall
from memfit.measure import find_blocks
from tests.helpers import tiny

WORLD = 2
GPU = "a100-40gb"


def padded_bytes(params) -> int:
    return sum(math.ceil(p.shape[0] / WORLD) * (p.numel() // p.shape[0]) * p.element_size()
               for p in params)


def groups(model) -> tuple[int, list[int]]:
    """The padded shard bytes of the root group and of each block (``techniques.sharding``
    Note 1: fully_shard per block, the root takes the rest)."""
    blocks = [list(model.get_submodule(n).parameters()) for n in find_blocks(model)]
    inside = {id(p) for b in blocks for p in b}
    root = [p for p in model.parameters() if id(p) not in inside]
    return padded_bytes(root), [padded_bytes(b) for b in blocks]


@pytest.fixture(scope="module")
def estimates():
    model, batch = tiny("gpt2")
    run = {(dev, off, mp): estimate_sharded(model, batch, "adamw", dev, world_size=WORLD,
                                            fsdp_offload=off, mp_policy=mp)
           for dev in ("cpu", GPU) for off in (False, True) for mp in (None, "bf16")
           if off or mp is None}
    return model, run


@pytest.mark.slow
@pytest.mark.parametrize("mp", [None, "bf16"])
def test_each_all_gather_reads_device_copies_of_the_host_shards(estimates, mp):
    """On the CPU the all-gather reads the host shards in place; on a GPU it reads a device
    copy of each (``FSDPParam.all_gather_inputs``). Over the forward (the same ops on both;
    nothing moves to the host before the backward) the GPU's timeline stands above the CPU's
    only at those reads, by exactly one group's padded shard bytes at each copy-in (fp32: the
    root's, then each block's), or, under the bf16 policy, by one parameter's at the cast of
    each shard."""
    model, run = estimates
    cpu, gpu = run["cpu", True, mp], run[GPU, True, mp]
    assert cpu.op_log == gpu.op_log
    fw, bw = gpu.phases["forward"], gpu.phases["backward"]
    above = [g - c for g, c in zip(gpu.timeline, cpu.timeline)]
    extra = Counter(d - above[fw - 1] for d in above[fw:bw] if d > above[fw - 1])
    if mp is None:
        root, blocks = groups(model)
        assert extra == Counter([root, *blocks])
        at = [i for i, op in enumerate(gpu.op_log[fw:bw]) if "all_gather_copy_in" in op]
        assert len(at) == 1 + len(blocks)
    else:
        assert extra == Counter(padded_bytes([p]) for p in model.parameters())


def test_the_sharded_state_is_host_memory(estimates):
    """Under offload no sharded parameter, gradient or optimizer state is on a GPU's device at
    any point of the step; without offload the device holds every parameter's padded shard
    throughout. The host holds at least the state: parameters, gradients, Adam's two moments."""
    model, run = estimates
    off, on = run[GPU, True, None], run[GPU, False, None]
    shards = padded_bytes(model.parameters())
    opt = off.phases["optimizer"]
    assert max(off.timeline_by_category["optimizer"]) == 0
    assert off.timeline_by_category["params"][opt:] == [0] * (len(off.timeline) - opt)
    assert max(off.timeline_by_category["grads"][opt:]) == 0
    assert min(on.timeline_by_category["params"]) >= shards
    assert off.host_peak_bytes >= 4 * shards
    assert on.host_peak_bytes == 0
    cpu_off, cpu_on = run["cpu", True, None], run["cpu", False, None]
    assert cpu_off.host_peak_bytes == 0          # one memory: nothing moves
    assert (cpu_off.peak_bytes, cpu_off.breakdown) == (cpu_on.peak_bytes, cpu_on.breakdown)


def test_the_planner_offloads_where_nothing_else_fits():
    """A budget halfway between the least a rank needs without offload (every block
    recomputed, micro-batches of 1: the sharded state and the optimizer step's temporaries stay)
    and with it: without offload nothing fits (BudgetTooSmall); left open, the planner picks
    FSDP2's CPU offload, and its re-traced device bytes are under the budget."""
    model, batch = tiny("gpt2", batch_size=2, seq_len=8)
    least = {off: estimate_sharded(model, batch, "adamw", GPU, world_size=WORLD,
                                   fsdp_offload=off, checkpoint="all",
                                   micro_batch_size=1).peak_bytes for off in (False, True)}
    assert least[True] < least[False]
    spec = memfit.devices.get_device(GPU)
    fixed = spec.cublas_workspace_bytes + spec.autograd_workspace_bytes + spec.cuda_context_bytes
    budget = fixed + (least[True] + least[False]) // 2
    with pytest.raises(BudgetTooSmall):
        memfit.plan(model, batch, budget, "adamw", GPU, gpus=WORLD, sharding="fsdp",
                    fsdp_offload=False)
    plan = memfit.plan(model, batch, budget, "adamw", GPU, gpus=WORLD, sharding="fsdp")
    assert plan.knobs.fsdp_offload is True
    assert plan.predicted_device_bytes <= budget
    assert any("host RAM" in r for r in plan.reasons)
    assert any("2 GPUs, FSDP2: does not fit" in r for r in plan.reasons)   # the tier before


def test_offload_is_weighed_last_unless_asked_for():
    """Where a layout without offload fits, the planner keeps the state on the device (offload
    needs host RAM memfit cannot see, and steps the optimizer on the host); asked for, it
    offloads."""
    model, batch = tiny("gpt2", batch_size=2, seq_len=8)
    kept = memfit.plan(model, batch, None, "adamw", GPU, gpus=WORLD, sharding="fsdp")
    asked = memfit.plan(model, batch, None, "adamw", GPU, gpus=WORLD, sharding="fsdp",
                        fsdp_offload=True)
    assert (kept.knobs.fsdp_offload, asked.knobs.fsdp_offload) == (False, True)
    assert asked.predicted_peak_bytes < kept.predicted_peak_bytes


def test_ddp_asked_for_weighs_no_offload():
    """``sharding="ddp"`` on a GPU: offload is FSDP2's, so nothing fitting is BudgetTooSmall
    (the offload tier is empty, not searched)."""
    model, batch = tiny("gpt2", batch_size=2, seq_len=8)
    with pytest.raises(BudgetTooSmall, match="no layout of up to 2 GPU"):
        memfit.plan(model, batch, 2 ** 20, "adamw", GPU, gpus=WORLD, sharding="ddp")
