"""The sharding planner: how many GPUs, FSDP2 or DDP, resharding, on top of the per-block search.

Note 1 (one rank from one device's trace). A candidate is ``(gpus N, sharding, reshard)``. Its
per-rank step is predicted from the single-device traces the planner already reads (the whole
batch and half of it, so every point is a line in the micro-batch): the step's categories are
rescaled point by point (``shard_estimate``) and a ``MemoryModel`` is built on the result, so the
per-block modes, micro-batch and precision are searched by the same MILP (``search``) for each
candidate, at the rank's batch. What changes per rank:
  - FSDP2: parameters, gradients and optimizer state are 1/N (sharded); during forward and
    backward the root's unsharded parameters (FSDP2 keeps the root unsharded after forward)
    and two blocks' (the one running and the one prefetched) are added; with
    ``reshard_after_forward=False`` every block's stays unsharded from its forward to its
    backward, so all of them are added (the peak sits at the backward's start). During
    backward the root's unsharded gradients (its head computes them first and its embeddings
    last) and two blocks' worth (a block's unsharded gradients and the reduce-scatter input
    copied from them) are added.
  - DDP: every rank holds everything, plus the reducer's gradient buckets: the gradients'
    bytes (flat buffers, rebuilt once at step 2), alive throughout.
The additions are constants over a phase, on the safe side of FSDP2's real lifetimes (a block's
buffers live only while it runs); the chosen candidate is re-traced with ``estimate_sharded``
(``api._plan_sharded``), and that trace is the answer.

Note 2 (the collectives' time). Over a ring of N ranks an all-gather or reduce-scatter of S
bytes moves ``S (N-1)/N`` bytes through each rank's link, an all-reduce twice that. The link is
the GPU's interconnect (``memfit._gpu_table.INTERCONNECT``: NVLink where the card has it, else
PCIe peer-to-peer at the host-link rate, or through host memory at half of it for GeForce
cards without peer-to-peer), at ``LINK_EFFICIENCY`` of its rate (NCCL's bus bandwidth on 8
NVLink GPUs reaches ~75-80% of the link's one-direction rate). FSDP2 all-gathers every
parameter in each micro-batch's forward, again in its backward when it resharded after
forward, and reduce-scatters the gradients in each micro-batch's backward
(never under no-sync, which would keep every gradient unsharded until the last one); DDP
all-reduces the gradients once per effective batch, in buckets.

Note 3 (overlap). FSDP2 prefetches one block ahead and runs its collectives on their own
stream, so a phase costs the longer of its compute and its collectives, plus what cannot hide:
the first all-gather of each forward and backward pass (nothing runs before it) and the last
reduce-scatter (nothing runs after it). DDP's all-reduce overlaps the last micro-batch's
backward, and its last bucket (``DDP_BUCKET_BYTES``) is paid in full. The optimizer steps on
1/N of the state under FSDP2 (its time divided by N), on all of it under DDP.

Note 4 (autocast under FSDP2). With bf16 autocast each block's unsharded fp32 parameters are
cast in its forward, and autocast's cast cache keeps the bf16 copies until the forward's
autocast region ends, so at the loss one bf16 copy of every block is alive on each rank
(measured: 0.377 GiB more per Llama-2-7B block, 2 to 6 blocks, 2 ranks, selective recompute:
one block's bf16 weights), which the single device's selective or full recompute does not keep.
They are added from the forward's start to the backward's.

Note 5 (FSDP2's mixed precision). ``mp_policy="bf16"`` is ``MixedPrecisionPolicy(param_dtype=
bf16, reduce_dtype=fp32)``: the sharded parameters stay fp32, each all-gather casts them to
bf16 first, so the unsharded parameters (and the all-gather's bytes on the link) are half of
fp32's, and the blocks compute in bf16 without autocast, so no cast cache keeps a bf16 copy
of every block (Note 4's addition is not made). It is weighed where the search's precision is
bf16 autocast, whose single-device trace stands in for its activations (bf16 compute in
both); the unsharded gradients are counted in fp32 (the reduce dtype: the safe side of a bf16
gradient and its fp32 reduce-scatter input). The chosen layout is re-traced with the policy
itself (``estimate_sharded(mp_policy="bf16")``, precision fp32), and that trace is the answer.
The stand-in over-counts, on the safe side: autocast's trace saves each block's bf16 weight
copy for its backward, which the policy never makes (its blocks compute with the unsharded
weights themselves). Measured: Llama-2-7B, batch 8 x 2048, 6 RTX 4090s, the chosen plan:
23.97 GiB modelled, 22.79 GiB re-traced; a tiny Llama on the CPU: about 30% over. So the
fewest GPUs it names can be one more than needed, never fewer.

Note 6 (FSDP2's CPU offload). ``CPUOffloadPolicy`` keeps the sharded parameters, gradients
and optimizer state in host memory (the optimizer steps on the host): none of the three is
left on the device, which holds the unsharded buffers as without offload, plus, during each
all-gather's copy-in, the device copy of the group's shards (the root's and the largest
block's, 1/N of each, added over the forward and backward on the safe side, as
``trace.fsdp_offload`` traces them). Each shard crosses the host link once per all-gather (added to
the collective's time: the copy runs on the all-gather's stream, ahead of it) and each
gradient shard once after its reduce-scatter; the optimizer step is the host's
(``time_model``'s optimizer-offload step), over 1/N of the state. Weighed only for a GPU
target (on the CPU host and device are one memory and offload moves nothing), and, unless the
caller asks for it, only where no layout without it fits (``layout_tiers``): it needs the
sharded state in host RAM (Llama-2-7B on 2 ranks: 63 GiB per rank), which memfit cannot see
for the machine a plan is for, and its host optimizer step is slower.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from memfit import _gpu_table
from memfit.devices import DeviceSpec
from memfit.knobs import Knobs
from memfit.planner.memory_model import outside_bytes

__all__ = ["Candidate", "LINK_EFFICIENCY", "ShardedTime", "candidates", "interconnect",
           "layout_tiers", "shard_estimate", "state_bytes"]

LINK_EFFICIENCY = 0.75
DDP_BUCKET_BYTES = 25 * 2 ** 20          # DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Candidate:
    """One data-parallel layout (Note 1)."""

    gpus: int
    sharding: str                        # "none", "ddp" or "fsdp"
    reshard_after_forward: bool = True   # FSDP2's; True for the others
    mp_policy: str | None = None         # FSDP2's MixedPrecisionPolicy: None or "bf16" (Note 5)
    offload: bool = False                # FSDP2's CPUOffloadPolicy (Note 6)

    def describe(self) -> str:
        if self.sharding == "none":
            return "1 GPU"
        if self.sharding == "ddp":
            return f"{self.gpus} GPUs, DDP"
        keep = "" if self.reshard_after_forward else ", unsharded forward to backward"
        mp = ", bf16 MixedPrecisionPolicy" if self.mp_policy else ""
        return f"{self.gpus} GPUs, FSDP2{keep}{mp}" + (", CPU offload" if self.offload else "")


def candidates(gpus, sharding: str | None, reshard, max_gpus: int,
               mp_policies: tuple = (None,), offloads: tuple = (False,)) -> list[Candidate]:
    """Every layout the caller left open: ``gpus`` an int or "auto" (1..``max_gpus``);
    ``mp_policies`` and ``offloads``: the FSDP2 mixed-precision policies and CPU offload
    settings weighed (Notes 5, 6)."""
    counts = range(1, max_gpus + 1) if gpus in (None, "auto") else [gpus]
    out = []
    for n in counts:
        if n == 1:
            if sharding in (None, "none"):
                out.append(Candidate(1, "none"))
            continue
        if sharding in (None, "ddp") and reshard is None:
            out.append(Candidate(n, "ddp"))
        if sharding in (None, "fsdp"):
            for r in ((True, False) if reshard is None else (reshard,)):
                for mp in mp_policies:
                    out += [Candidate(n, "fsdp", r, mp, off) for off in offloads]
    return out


def _mp_policies(k: Knobs, p: str) -> tuple:
    """FSDP2's mixed-precision policies weighed: the caller's, or none and bf16 where the
    precision is bf16 (Note 5)."""
    if k.mp_policy:
        return (k.mp_policy,)
    return (None, "bf16") if p == "bf16" else (None,)


def layout_tiers(k: Knobs, gpus, b: int, p: str, spec) -> list[list[Candidate]]:
    """The layouts ``k`` leaves open for ``gpus`` (an int or "auto") at batch ``b`` on ``spec``,
    in the order they are searched: for a GPU with ``fsdp_offload`` left open, the layouts
    without FSDP2's CPU offload first, and with it only where none of those fits (Note 6);
    on the CPU offload moves nothing and is not weighed."""
    def tier(offload: bool) -> list[Candidate]:
        out = candidates(gpus, "fsdp" if k.mp_policy or offload else k.sharding,
                         k.reshard_after_forward, b, _mp_policies(k, p), (offload,))
        return [c for c in out if c.offload] if offload else out      # FSDP2's own option

    if k.fsdp_offload is not None:
        return [tier(bool(k.fsdp_offload))]
    open_ = spec.kind == "cuda" and k.sharding in (None, "fsdp")     # DDP has no offload
    return [tier(False), tier(True)] if open_ else [tier(False)]


def interconnect(spec: DeviceSpec) -> tuple[str, float]:
    """The GPU-to-GPU link of ``spec`` and its one-direction rate in B/s (Note 2)."""
    row = _gpu_table.INTERCONNECT.get(spec.name)
    if row is not None:
        return row
    if spec.kind == "cuda" and spec.name in _gpu_table.NO_P2P:
        return "PCIe through host memory (no peer-to-peer)", spec.host_link_bytes_per_s / 2
    return "PCIe peer-to-peer", spec.host_link_bytes_per_s


@dataclass(frozen=True)
class _Sizes:
    """Parameter bytes of the model's parts, read off a trace."""

    params: float           # all parameters
    root: float             # outside the blocks (embeddings, final norm, head)
    max_block: float        # the largest block
    blocks: float           # all blocks


def _sizes(est) -> _Sizes:
    per = [est.modules[n].param_bytes for n in est.blocks if n in est.modules]
    cats = est.timeline_by_category
    start = est.phases.get("optimizer", len(est.timeline))
    params = float(max(cats["params"][:start], default=0))
    return _Sizes(params, max(params - sum(per), 0.0), float(max(per, default=0)),
                  float(sum(per)))


def state_bytes(est) -> float:
    """Parameters, gradients and optimizer state of one device's plain step (what sharding
    divides), at their largest."""
    cats = est.timeline_by_category
    return float(max(np.add(np.add(cats["params"], cats["grads"]), cats["optimizer"])))


def shard_estimate(est, cand: Candidate, extra_bytes: int = 0, context_bytes: int = 0,
                   reserve_ratio: float = 1.0):
    """``est`` (one device's traced step) as one rank of ``cand`` predicts it (Note 1), with
    ``extra_bytes`` held throughout (e.g. cuBLAS workspaces) and ``context_bytes`` outside the
    allocator; the allocator reserves ``reserve_ratio`` times the allocated peak (1: reserved
    is allocated, as a rank's CPU trace counts it)."""
    cats = {c: np.asarray(v, dtype=np.float64) for c, v in est.timeline_by_category.items()}
    n = len(est.timeline)
    fw, bw = est.phases.get("forward", 0), est.phases.get("backward", n)
    opt = est.phases.get("optimizer", n)
    s = _sizes(est)
    add = {c: np.zeros(n) for c in cats}
    if cand.sharding == "fsdp":
        N = cand.gpus
        for c in ("params", "grads", "optimizer"):                # Note 6: all on the host
            add[c] -= cats[c] * (1 if cand.offload else 1 - 1 / N)
        unsharded = s.root + (2 * s.max_block if cand.reshard_after_forward else s.blocks)
        if cand.mp_policy:                                        # Note 5: bf16 copies
            unsharded /= 2
        add["params"][fw:opt] += unsharded
        if cand.offload:                     # Note 6: the device copy of a group's shards
            add["params"][fw:opt] += (s.root + s.max_block) / N
        if getattr(est.knobs, "precision", None) == "bf16" and not cand.mp_policy:   # Note 4
            add["params"][fw:bw] += s.blocks / 2
        add["grads"][bw:opt] += s.root + 2 * s.max_block
    elif cand.sharding == "ddp":
        grads = float(max(cats["grads"], default=0))
        add["other"] += grads
    add["other"] += extra_bytes
    new = {c: (cats[c] + add[c]).round().astype(np.int64).tolist() for c in cats}
    total = np.asarray(est.timeline, dtype=np.float64) + sum(add.values())
    timeline = total.round().astype(np.int64).tolist()
    peak = int(max(timeline)) + outside_bytes(est)     # a GPU trace's workspaces, kept
    return dataclasses.replace(est, timeline=timeline, timeline_by_category=new, peak_bytes=peak,
                               reserved_bytes=round(peak * reserve_ratio),
                               context_bytes=context_bytes)


class ShardedTime:
    """A ``TimeModel`` of one device's step, as one rank of ``cand`` runs it (Notes 2-3): what
    the search asks of a time model, with the collectives added."""

    def __init__(self, time, est, cand: Candidate, spec: DeviceSpec, param_dtype_bytes: int = 4):
        self.base, self.cand = time, cand
        s = _sizes(est)
        _, rate = interconnect(spec)
        link = rate * LINK_EFFICIENCY
        N = cand.gpus
        ring = (N - 1) / N if N > 1 else 0.0
        self._param_s = s.params / 4 * param_dtype_bytes * ring / link   # all parameters, once
        self._first_s = (s.root + s.max_block) / 4 * param_dtype_bytes * ring / link
        self._grad_s = s.params * ring / link            # fp32 gradients (reduce dtype)
        if cand.offload:          # Note 6: each shard crosses the host link with its collective
            host = spec.host_link_bytes_per_s
            self._param_s += s.params / N / host
            self._first_s += (s.root + s.max_block) / N / host
            self._grad_s += s.params / N / host
        self._bucket_s = min(DDP_BUCKET_BYTES, s.params) * ring / link
        total = max(est.fw_flops + est.bw_flops, 1)
        self._fw_share = est.fw_flops / total

    def __getattr__(self, name):          # mode_s, forward_backward_s, ... are the base's
        return getattr(self.base, name)

    def comm_s(self, m: int, b: int) -> float:
        """Seconds of collectives one effective batch exposes beyond compute (Note 3)."""
        c, n = self.cand, -(-b // m)
        if c.sharding == "none" or c.gpus < 2:
            return 0.0
        compute = self.base.forward_backward_s(n, b)
        fw, bw = compute * self._fw_share, compute * (1 - self._fw_share)
        if c.sharding == "ddp":
            per_bw = bw / n
            return max(2 * self._grad_s - per_bw, 0.0) + 2 * self._bucket_s
        ag_bw = self._param_s if c.reshard_after_forward else 0.0
        exposed = max(n * self._param_s - fw, 0.0) + max(n * (ag_bw + self._grad_s) - bw, 0.0)
        return exposed + n * self._first_s * (2 if c.reshard_after_forward else 1) + \
            self._first_s / 2

    def optimizer_step_s(self, offload_optimizer: bool) -> float:
        step = self.base.optimizer_step_s(offload_optimizer or self.cand.offload)   # Note 6
        return step / self.cand.gpus if self.cand.sharding == "fsdp" else step

    def step_s(self, m: int, b: int, modes, offload_optimizer: bool) -> float:
        return (self.base.step_s(m, b, modes, offload_optimizer)
                - self.base.optimizer_step_s(offload_optimizer)
                + self.optimizer_step_s(offload_optimizer) + self.comm_s(m, b))
