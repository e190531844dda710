"""``estimate_sharded``: one rank's memory in an N-rank FSDP2 or DDP job, from one process.

Note 1 (what is traced). The model is faked (``FakeCopier``), sharded by PyTorch's own engine
(``techniques.sharding``: ``fully_shard`` per block and at the root, or DDP) over a fake process
group of ``world_size`` ranks (c10d's "fake" backend: collectives return at once, moving nothing),
and memfit's Runner (the one ``memfit.fit`` trains with) runs two steps on it: the first, uncounted,
is the warm-up (optimizer state, FSDP2's lazy init, the previous step's sharded gradients alive at
the next step's start); the second is counted. So the figures are those of a steady-state step on
one rank: sharded parameters, gradients and optimizer state, the all-gather buffers and the
unsharded parameters of the block in flight and of the one prefetched, the reduce-scatter input and
output buffers, resharding after forward or not, DDP's buckets.

Note 2 (targets). For a CPU target (``device="cpu"``) the figures are exact: the tests run
the same step in real 2- and 4-process gloo jobs and compare each rank's ``track``
(``tests/distributed``). For a GPU target the same CPU trace is returned as allocated bytes
(``basis="cpu-trace"``, reserved = allocated + workspaces, Note 7): memfit's CUDA models
(autocast kernels, the caching allocator's replay) are not applied under sharding yet, nor
the collectives' stream ordering (on a GPU FSDP2 frees a buffer when the collective stream is
done with it, not when Python drops it); a note says so. ``fsdp_offload`` is exact for a CPU target, where
host and device are one memory and FSDP2's offload moves nothing; for a GPU target the trace
is told what the GPU keeps on the host (the sharded parameters, gradients and optimizer state,
``host_peak_bytes``) and the device copies of the shards it makes before each all-gather
(``trace.fsdp_offload``).

Note 3 (knobs). ``precision`` ("fp32" or "bf16" autocast), ``micro_batch_size`` (DDP
all-reduces on the last micro-batch, FSDP2 reduce-scatters each, as the Runner does), ``checkpoint``, ``offload``,
``max_grad_norm``, ``zero_grad`` and ``optimizer_impl`` work as in ``estimate``; fp16's
GradScaler, bf16-pure's master weights, ``offload_optimizer`` and ``remat`` are refused (each
rebuilds the optimizer or the parameters under FSDP2's DTensors, untested here).

Note 4 (DDP's warm-up). DDP's reducer rebuilds its buckets once, at the second step's
forward, in the order the first backward produced the gradients; rank 0 broadcasts that order
and every rank reads it back, which fakes cannot. The buckets' total is the gradients' bytes
whatever the order (flat buffers, no padding on the CPU), so the trace's warm-up step runs
under ``no_sync`` (the reducer records no order and never rebuilds) and the counted step is
like a real run's third: the real runs of the tests measure step 3, after the rebuild.

Note 5 (which mode shards). ``fully_shard`` runs outside the fake mode: it makes every new
tensor from the (fake) parameters themselves, which keeps them fake, while
``reshard_after_forward=<int>`` builds its smaller mesh from the real rank tensor of the
``DeviceMesh``, which the fake mode refuses. DDP runs inside it: its C++ reducer allocates
the buckets with ``at::empty``, which must make fakes.

Note 6 (a short warm-up). The warm-up runs the effective batch's first micro-batch only: what
the counted step starts from (the optimizer state, FSDP2's lazy init, sharded gradients of
their full size) is the same after one micro-batch as after all of them, and a 7B rank's
micro-batch costs the trace about 12 s.

Note 7 (the card). For a GPU target ``device_bytes`` counts what one device's estimate counts
around the allocator: the cuBLAS (and cuBLASLt) and autograd workspaces inside the reservation,
the CUDA context, the kernels a step loads and cuDNN's when a convolution ran outside it
(``trace.card``), so ``estimate(gpus=N)`` and ``plan(gpus=N)`` print the same device bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn

from memfit.api._setup import build_runner, resolve_device, resolve_precision
from memfit.api._validate import check_batch
from memfit.api._estimate_result import Estimate
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.sharding import Sharding
from memfit.trace import FakeCopier, profile_step
from memfit.trace.card import card_breakdown, step_workspace_bytes
from memfit.trace.fsdp_offload import OffloadPlacement
from memfit.trace.sharded import fake_process_group, trace_ddp_hook
from memfit.units import parse_bytes

__all__ = ["estimate_sharded", "zero_per_rank_bytes"]

_REFUSED = {"offload_optimizer": "offload_optimizer", "remat": "remat"}


def estimate_sharded(model: nn.Module, batch, optimizer="adamw", device=None,
                     loss_fn: Callable | None = None, *, world_size: int,
                     sharding: str = "fsdp", reshard_after_forward: bool | int = True,
                     mp_policy: str | None = None, fsdp_offload: bool = False,
                     bucket_cap_mb: float = 25.0, rank: int = 0, budget=None,
                     count_fn: Callable | None = None, **knobs) -> Estimate:
    """Predict one rank's memory for a steady-state step of ``model`` trained on ``batch``
    (one rank's batch) by ``world_size`` ranks with FSDP2 (``sharding="fsdp"``) or DDP.

    ``reshard_after_forward``, ``mp_policy`` (None or "bf16":
    ``MixedPrecisionPolicy(bf16, reduce fp32)``), ``fsdp_offload`` (``CPUOffloadPolicy``) are
    FSDP2's; ``bucket_cap_mb`` DDP's. ``rank``: the rank traced; 0 (the default) holds the most
    where a dimension does not split evenly over the ranks (FSDP2 chunks dim 0: the last ranks get
    less). ``optimizer``, ``device``, ``loss_fn``, ``budget``, ``count_fn`` and the knobs as in
    ``memfit.estimate`` (Note 3). Traced on fake tensors under a fake process group (Notes 1, 2):
    ``model`` may be on ``meta`` and is not touched; no process group may be initialized in this
    process (c10d holds one default group per process).
    """
    config = Sharding.Config(kind=sharding, reshard_after_forward=reshard_after_forward,
                             mp_policy=mp_policy, offload=fsdp_offload,
                             bucket_cap_mb=bucket_cap_mb)
    k = Knobs.from_kwargs(**knobs)
    k.check_available()
    for name, knob in _REFUSED.items():
        if getattr(k, name):
            raise ValueError(f"{knob} is not supported with sharding yet: estimate without it")
    spec = resolve_device(model, device)
    k = k.replace(precision=resolve_precision(k.precision, spec))
    if k.precision not in ("fp32", "bf16"):
        raise ValueError(f"precision={k.precision!r} is not supported with sharding yet: use "
                         "'fp32' or 'bf16' (autocast), or mp_policy='bf16' (FSDP2's own)")
    if k.precision == "bf16" and mp_policy is not None:
        raise ValueError("precision='bf16' (autocast) and mp_policy='bf16' both cast the "
                         "compute: pick one (mp_policy='bf16' is FSDP2's)")
    limit = parse_bytes(budget) if budget is not None else spec.usable_bytes
    recipe = OptimizerRecipe(optimizer, impl=k.optimizer_impl)
    trainable = [p for p in model.parameters() if p.requires_grad]
    recipe.check_params(trainable)
    batch = prepare_batch(batch)
    check_batch(model, batch, loss_fn)
    batch_size_of(batch)

    copier = FakeCopier("cpu")
    fake_model = copier.module(model)
    fake_model.train(model.training)
    fake_batch = copier.tree(batch)
    with fake_process_group(world_size, rank) as mesh:
        with copier.mode if config.kind == "ddp" else contextlib.nullcontext():   # Note 5
            sharded = Sharding(config).apply(fake_model, mesh, init_sync=False)
        if config.kind == "ddp":
            trace_ddp_hook(sharded)
        with copier.mode:
            runner = build_runner(sharded, recipe, k, plan=Plan(k), origin=trainable,
                                  loss_fn=loss_fn, count_fn=count_fn)
            fake_batch = runner.prepare(fake_batch)
        placement = None
        if config.offload and spec.kind == "cuda":          # Note 2
            placement = OffloadPlacement(runner.model, runner.optimizer)
            runner.optimizer.host_tensors = placement.host_tensors

        def run(on_phase):
            with placement.step(on_phase) if placement else \
                    contextlib.nullcontext(on_phase) as mark:
                runner.run(fake_batch, mark)

        def warm_up():      # one micro-batch (Note 6); DDP: without its bucket rebuild (Note 4)
            with sharded.no_sync() if config.kind == "ddp" else contextlib.nullcontext():
                with copier.mode:
                    first = runner.accumulation.split(fake_batch)[0]
                runner.run(first, lambda _: None)

        prof, _ = profile_step(run, copier=copier, model=runner.model,
                               optimizer=runner.optimizer, warm_up=warm_up)
    notes = [_describe(config, world_size, rank)]
    reserved, context, card = prof.peak_bytes, 0, None
    if spec.kind == "cuda":         # the card around the allocator, as for one device (Note 7)
        workspaces = step_workspace_bytes(spec)
        reserved = prof.peak_bytes + workspaces
        card = card_breakdown(spec, reserved, prof.op_log, workspaces)
        context = card.outside_allocator_bytes
        notes.append("GPU target: the CPU trace's allocated bytes, plus the cuBLAS and autograd "
                     "workspaces, the CUDA context and the kernels a step loads; CUDA's "
                     "autocast kernels, the caching allocator's rounding and the collectives' "
                     "stream-ordered frees are not modelled under sharding yet "
                     "(memfit.api._sharded Note 2)")
        notes += list(card.notes)
    return Estimate(
        peak_bytes=prof.peak_bytes, reserved_bytes=reserved, context_bytes=context, card=card,
        host_peak_bytes=prof.host_peak_bytes, breakdown=prof.breakdown, timeline=prof.timeline,
        op_log=prof.op_log, timeline_by_category=prof.timeline_by_category, phases=prof.phases,
        modules=prof.modules, blocks=prof.blocks, fw_flops=prof.fw_flops,
        bw_flops=prof.bw_flops, device=spec, limit_bytes=limit, knobs=k,
        trace_seconds=prof.trace_seconds, notes=notes, basis="cpu-trace",
        knobs_blocks=dict(runner.applied.blocks), op_costs=prof.op_costs)


def _describe(config: Sharding.Config, world_size: int, rank: int) -> str:
    if config.kind == "ddp":
        return (f"DDP over {world_size} ranks (bucket_cap_mb={config.bucket_cap_mb}): figures "
                f"of rank {rank}")
    mp = "fp32" if config.mp_policy is None else "bf16 params, fp32 reduce"
    return (f"FSDP2 over {world_size} ranks: fully_shard per block and at the root, "
            f"reshard_after_forward={config.reshard_after_forward}, {mp}"
            + (", CPU offload" if config.offload else "") + f": figures of rank {rank}"
            + (" (the largest where dimensions split unevenly)" if rank == 0 else ""))


def zero_per_rank_bytes(model, batch, world_size: int, optimizer="adamw", device="cpu",
                        **knobs) -> dict[int, int]:
    """memfit's predicted peak bytes of one rank under DeepSpeed's ZeRO stages 0-3; ``batch`` is
    one rank's. Stages 0 and 3 are traced (DDP and FSDP2 over a fake group of ``world_size``
    ranks); stages 1 and 2 take the DDP trace's peak less what ZeRO partitions there (1: the
    optimizer state, 2: also the gradients, each to 1/N): a model, not a trace (DeepSpeed
    itself is not traced)."""
    ddp = estimate_sharded(model, batch, optimizer, device, world_size=world_size,
                           sharding="ddp", **knobs)
    fsdp = estimate_sharded(model, batch, optimizer, device, world_size=world_size, **knobs)
    i = max(range(len(ddp.timeline)), key=ddp.timeline.__getitem__)
    cats = ddp.timeline_by_category
    keep = 1 - 1 / world_size
    opt, grads = cats["optimizer"][i], cats["grads"][i]
    return {0: ddp.peak_bytes, 1: int(ddp.peak_bytes - opt * keep),
            2: int(ddp.peak_bytes - (opt + grads) * keep), 3: fsdp.peak_bytes}
