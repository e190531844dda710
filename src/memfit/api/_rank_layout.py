"""One rank of an N-rank FSDP2 or DDP job, as ``traced_estimate`` traces it: the layout read
from the knobs, the fake model sharded by PyTorch's own engine over a fake process group, the
warm-up, and the card around the allocator. There is one estimator (``api.estimate``); sharding
is a technique (``techniques.sharding``) applied to its fake model, and this module is what
that technique needs around the trace.

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
done with it, not when Python drops it); a note says so. ``fsdp_offload`` is exact for a CPU
target, where host and device are one memory and FSDP2's offload moves nothing; for a GPU target
the trace is told what the GPU keeps on the host (the sharded parameters, gradients and
optimizer state, ``host_peak_bytes``) and the device copies of the shards it makes before each
all-gather (``trace.fsdp_offload``).

Note 3 (knobs). ``precision`` ("fp32" or "bf16" autocast), ``micro_batch_size`` (DDP
all-reduces on the last micro-batch, FSDP2 reduce-scatters each, as the Runner does),
``checkpoint``, ``offload``, ``max_grad_norm``, ``zero_grad`` and ``optimizer_impl`` work as for
one device; fp16's GradScaler, bf16-pure's master weights, ``offload_optimizer`` and ``remat``
are refused (each rebuilds the optimizer or the parameters under FSDP2's DTensors, untested
here), and so are a user's ``step``, a ``scheduler`` and an allocator setting.

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
from dataclasses import dataclass

from memfit.knobs import Knobs
from memfit.techniques.sharding import Sharding
from memfit.trace.allocator import AllocatorConfig
from memfit.trace.card import card_breakdown, step_workspace_bytes
from memfit.trace.fsdp_offload import OffloadPlacement
from memfit.trace.sharded import fake_process_group, trace_ddp_hook

__all__ = ["RankLayout", "is_sharded", "refuse_fsdp_knobs_with_ddp", "LAYOUT_KNOBS"]

LAYOUT_KNOBS = ("gpus", "sharding", "reshard_after_forward", "fsdp_offload", "mp_policy")


def refuse_fsdp_knobs_with_ddp(k: Knobs) -> None:
    """FSDP2's own knobs given with ``sharding="ddp"``: a ``ValueError`` naming them."""
    if k.sharding == "ddp" and (k.reshard_after_forward is not None or k.fsdp_offload
                                or k.mp_policy):
        raise ValueError("reshard_after_forward, fsdp_offload and mp_policy are FSDP2's: use "
                         "sharding='fsdp', or leave them unset with 'ddp'")


def is_sharded(k: Knobs) -> bool:
    """Whether the knobs ask for one rank of a data-parallel job."""
    return k.sharding not in (None, "none") or k.gpus not in (None, 1) or \
        k.reshard_after_forward is not None or bool(k.fsdp_offload) or k.mp_policy is not None


@dataclass(frozen=True)
class RankLayout:
    """The data-parallel layout one traced rank belongs to."""

    config: Sharding.Config
    world_size: int
    rank: int = 0

    @classmethod
    def of(cls, k: Knobs, *, rank: int = 0, bucket_cap_mb: float = 25.0) -> RankLayout | None:
        """The layout the knobs ask for, None for one device."""
        if not is_sharded(k):
            return None
        if k.gpus in (None, 1) or k.gpus == "auto" or k.sharding in (None, "none"):
            given = [f"{n}={v!r}" for n, v in (("gpus", k.gpus), ("sharding", k.sharding))
                     if v is not None] or ["an FSDP2 knob (reshard_after_forward, fsdp_offload, "
                                           "mp_policy)"]   # no Python None in the words
            raise ValueError(f"{', '.join(given)}: one rank of a "
                             "data-parallel job needs both gpus=N (N >= 2 ranks; 'auto' is for "
                             "memfit.plan) and sharding='fsdp' or sharding='ddp'")
        refuse_fsdp_knobs_with_ddp(k)
        raf = True if k.reshard_after_forward is None else k.reshard_after_forward
        config = Sharding.Config(kind=k.sharding, reshard_after_forward=raf,
                                 mp_policy=k.mp_policy, offload=bool(k.fsdp_offload),
                                 bucket_cap_mb=bucket_cap_mb)
        return cls(config, k.gpus, rank)

    @staticmethod
    def refuse(k: Knobs, *, step=None, scheduler=None,
               allocator: AllocatorConfig | None = None) -> None:
        """What a rank's trace does not take (Note 3)."""
        if allocator == AllocatorConfig():
            allocator = None             # the default: nothing to model differently
        for name, value in (("step", step), ("scheduler", scheduler), ("allocator", allocator)):
            if value is not None:
                raise ValueError(f"{name} with sharding is not supported yet: estimate the "
                                 f"sharded step without {name}")
        for name in ("offload_optimizer", "remat"):
            if getattr(k, name):
                raise ValueError(f"{name} is not supported with sharding yet: estimate "
                                 "without it")
        if k.optimizer_impl == "compiled":
            raise ValueError("optimizer_impl='compiled' is not modelled with sharding yet: "
                             "estimate the sharded step with the optimizer as given")

    def check_precision(self, precision: str) -> None:
        """``precision`` resolved for the target: autocast bf16 or fp32 only (Note 3)."""
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision={precision!r} is not supported with sharding yet: use "
                             "'fp32' or 'bf16' (autocast), or mp_policy='bf16' (FSDP2's own)")
        if precision == "bf16" and self.config.mp_policy is not None:
            raise ValueError("precision='bf16' (autocast) and mp_policy='bf16' both cast the "
                             "compute: pick one (mp_policy='bf16' is FSDP2's)")

    def shard(self, stack: contextlib.ExitStack, fake_model, copier):
        """Enter the fake process group on ``stack`` and shard ``fake_model`` over it; the
        model to train (Notes 1, 5)."""
        mesh = stack.enter_context(fake_process_group(self.world_size, self.rank))
        ddp = self.config.kind == "ddp"
        with copier.mode if ddp else contextlib.nullcontext():
            sharded = Sharding(self.config).apply(fake_model, mesh, init_sync=False).model
        if ddp:
            trace_ddp_hook(sharded)
        return sharded

    def placement(self, runner, spec) -> OffloadPlacement | None:
        """What a GPU keeps on the host under FSDP2's CPU offload (Note 2)."""
        if not (self.config.offload and spec.kind == "cuda"):
            return None
        placement = OffloadPlacement(runner.model, runner.optimizer)
        runner.optimizer.host_tensors = placement.host_tensors
        return placement

    def warm_up(self, runner, fake_batch, copier) -> None:
        """One micro-batch (Note 6); DDP: without its bucket rebuild (Note 4)."""
        ddp = self.config.kind == "ddp"
        with runner.model.no_sync() if ddp else contextlib.nullcontext():
            with copier.mode:
                first = runner.accumulation.split(fake_batch)[0]
            runner.run(first, lambda _: None)

    def card(self, peak_bytes: int, op_log, spec):
        """(reserved, context, card, notes) of a GPU target around the allocator (Note 7)."""
        notes = [self.describe()]
        if spec.kind != "cuda":
            return peak_bytes, 0, None, notes
        workspaces = step_workspace_bytes(spec)
        reserved = peak_bytes + workspaces
        card = card_breakdown(spec, reserved, op_log, workspaces)
        notes.append("GPU target: the CPU trace's allocated bytes, plus the cuBLAS and autograd "
                     "workspaces, the CUDA context and the kernels a step loads; CUDA's "
                     "autocast kernels, the caching allocator's rounding and the collectives' "
                     "stream-ordered frees are not modelled under sharding yet "
                     "(memfit.api._rank_layout Note 2)")
        return reserved, card.outside_allocator_bytes, card, notes + list(card.notes)

    def describe(self) -> str:
        c, n, rank = self.config, self.world_size, self.rank
        if c.kind == "ddp":
            return f"DDP over {n} ranks (bucket_cap_mb={c.bucket_cap_mb}): figures of rank {rank}"
        mp = "fp32" if c.mp_policy is None else "bf16 params, fp32 reduce"
        return (f"FSDP2 over {n} ranks: fully_shard per block and at the root, "
                f"reshard_after_forward={c.reshard_after_forward}, {mp}"
                + (", CPU offload" if c.offload else "") + f": figures of rank {rank}"
                + (" (the largest where dimensions split unevenly)" if rank == 0 else ""))
