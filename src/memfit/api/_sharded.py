"""``estimate_sharded``: one rank's memory in an N-rank FSDP2 or DDP job, from one process,
as ``memfit.estimate(gpus=N, sharding=...)`` traces it (``api._rank_layout`` says how), with
the two arguments the knobs do not carry (``rank``, ``bucket_cap_mb``); and the per-stage
figures of DeepSpeed's ZeRO taken from those traces.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from memfit.api._estimate_result import Estimate
from memfit.api._rank_layout import LAYOUT_KNOBS, RankLayout, is_sharded
from memfit.api.estimate import traced_estimate
from memfit.knobs import Knobs
from memfit.techniques.sharding import Sharding
from memfit.trace import FakeCopier

__all__ = ["estimate_sharded", "zero_per_rank_bytes"]


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
    ``memfit.estimate``, which this is with ``gpus=world_size, sharding=sharding``
    (``memfit.api._rank_layout``): traced on fake tensors under a fake process group, ``model``
    may be on ``meta`` and is not touched; no process group may be initialized in this process
    (c10d holds one default group per process).
    """
    config = Sharding.Config(kind=sharding, reshard_after_forward=reshard_after_forward,
                             mp_policy=mp_policy, offload=fsdp_offload,
                             bucket_cap_mb=bucket_cap_mb)
    k = Knobs.from_kwargs(**knobs)
    if is_sharded(k):
        raise ValueError("estimate_sharded takes the layout as world_size, sharding, "
                         "reshard_after_forward, mp_policy and fsdp_offload: drop "
                         + ", ".join(f"{n}=" for n in LAYOUT_KNOBS if getattr(k, n) is not None))
    return traced_estimate(model, batch, optimizer, device, loss_fn, k, FakeCopier("cpu"),
                           budget=budget, count_fn=count_fn,
                           layout=RankLayout(config, world_size, rank))[0]


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
