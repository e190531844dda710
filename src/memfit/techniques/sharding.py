"""Data parallelism on PyTorch's own engines: FSDP2 (``fully_shard``) per block and at the root,
or plain DDP (``DistributedDataParallel``).

Note 1 (where ``fully_shard`` goes). Each block (``memfit.measure.find_blocks``: the repeated
layers, in execution order) is its own FSDP2 parameter group, and the root takes what is left
(embeddings, final norm, head), as torchtitan applies it. So one block's parameters are
unsharded at a time (plus the one prefetched ahead), and each block's gradients are
reduce-scattered as its backward ends. ``reshard_after_forward`` is handed to every group as is
(an int: reshard to that smaller world after forward, FSDP2's own meaning); FSDP2 itself keeps
the root unsharded after forward (its parameters are needed first in backward).

Note 2 (mixed precision). ``mp_policy="bf16"`` is ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the all-gathered (unsharded) parameters and the compute are bf16, the
gradients are reduce-scattered in fp32 and the sharded parameters, gradients and optimizer
state stay fp32 -- torchtitan's default. No autocast is needed on top.

Note 3 (DDP). ``kind="ddp"`` wraps the model in ``DistributedDataParallel``: every rank holds
the whole model, its gradients and optimizer state, plus the reducer's gradient buckets
(``bucket_cap_mb``, the reducer allocates them itself). The ``Change``'s model is the
wrapper; the model's parameters are the wrapper's.

The mesh is given by the caller (the real default group's, or a fake one for a trace,
``memfit.trace.sharded``), built outside any ``FakeTensorMode``: ``DeviceMesh`` reads its rank
list back as Python ints, which a fake tensor cannot give.

Note 4 (what ``remove`` undoes). ``apply`` returns a ``Change`` (``techniques._protocol``) with
no hooks of memfit's: DDP's are inside its wrapper (train the model passed in, not the wrapper,
and none of them run), and FSDP2's ``fully_shard`` changes the model's class and parameters in
place, which PyTorch offers no way to undo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memfit.measure import find_blocks
from memfit.techniques._protocol import Change

__all__ = ["Sharding", "KINDS", "MP_POLICIES"]

KINDS = ("fsdp", "ddp")
MP_POLICIES = (None, "bf16")


class Sharding:
    """Shard ``model`` over a device mesh with FSDP2, or replicate it with DDP."""

    @dataclass(frozen=True)
    class Config:
        kind: str = "fsdp"                       # "fsdp" (FSDP2 fully_shard) or "ddp"
        reshard_after_forward: bool | int = True  # FSDP2's own argument (Note 1)
        mp_policy: str | None = None             # None (fp32) or "bf16" (Note 2)
        offload: bool = False                    # FSDP2's CPUOffloadPolicy (sharded state on host)
        bucket_cap_mb: float = 25.0              # DDP's gradient bucket size, in MiB

        def __post_init__(self):
            if self.kind not in KINDS:
                raise ValueError(f"sharding={self.kind!r}: use one of {', '.join(KINDS)}")
            raf = self.reshard_after_forward
            if not isinstance(raf, (bool, int)) or (not isinstance(raf, bool) and raf < 1):
                raise ValueError(f"reshard_after_forward={raf!r}: use True, False or a positive "
                                 "int (the smaller world size to reshard to after forward)")
            if self.mp_policy not in MP_POLICIES:
                raise ValueError(f"mp_policy={self.mp_policy!r}: use None (fp32) or 'bf16'")
            if self.kind == "ddp" and (self.mp_policy is not None or self.offload
                                       or raf is not True):
                raise ValueError("reshard_after_forward, mp_policy and fsdp_offload are FSDP's: "
                                 "with sharding='ddp' leave them at their defaults")
            if self.bucket_cap_mb <= 0:
                raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb}: must be positive")

    def __init__(self, config: Config | None = None):
        self.config = config or Sharding.Config()

    def apply(self, model: nn.Module, mesh, *, init_sync: bool = True) -> Change:
        """Shard ``model`` in place over ``mesh`` (FSDP2), or wrap it (DDP). The ``Change``'s
        model is the one to train (the DDP wrapper, or ``model`` itself); ``remove()`` has
        nothing to take off (DDP: drop the wrapper; FSDP2's sharding stays, Note 4).
        ``init_sync=False``: DDP skips its start-up check and broadcast of the parameters (a
        trace's fakes have no values)."""
        c = self.config
        if c.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            ddp = DistributedDataParallel(model, process_group=mesh.get_group(),
                                          bucket_cap_mb=c.bucket_cap_mb, init_sync=init_sync)
            return Change(model=ddp, notes=(f"DDP over {mesh.size()} ranks, gradient buckets "
                                            f"of {c.bucket_cap_mb} MiB",))
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        kwargs = {"mesh": mesh, "reshard_after_forward": c.reshard_after_forward}
        if c.mp_policy == "bf16":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
        if c.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no repeated blocks to shard one by "
                             "one (memfit.measure.find_blocks found none): FSDP2 would "
                             "unshard the whole model at once; use sharding='ddp'")
        for name in blocks:                    # Note 1
            fully_shard(model.get_submodule(name), **kwargs)
        fully_shard(model, **kwargs)
        return Change(model=model, notes=(f"FSDP2 over {mesh.size()} ranks: fully_shard on "
                                          f"{len(blocks)} blocks and at the root",))
