"""``Estimate``: one predicted training step, what ``memfit.estimate`` (one device) and
``estimate_sharded`` (one rank of a data-parallel job) return."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.devices import DeviceSpec
from memfit.knobs import Knobs
from memfit.measure import ModuleRecord
from memfit.memplan import StorageLog
from memfit.modes import Mode
from memfit.trace.card import CardBreakdown

__all__ = ["Estimate"]


@dataclass
class Estimate:
    """A predicted step. Bytes are device bytes; ``peak_bytes`` is the allocated peak."""

    peak_bytes: int
    reserved_bytes: int                # allocator reservation at the peak (== peak on CPU)
    context_bytes: int                 # bytes outside the allocator: context, kernels, cuDNN
                                       # (``card``'s outside_allocator_bytes; 0 on CPU)
    host_peak_bytes: int               # peak of memfit's host memory (offload), not the device
    breakdown: dict[str, int]          # category -> bytes at the peak
    timeline: list[int]                # live bytes after each op of the step
    op_log: list[str]                  # the aten op behind each timeline point
    timeline_by_category: dict[str, list[int]]
    phases: dict[str, int]             # "forward"/"backward"/"optimizer" -> first op index
    modules: dict[str, ModuleRecord]   # per module, in execution order
    blocks: list[str]                  # the repeated layers, in execution order
    fw_flops: int
    bw_flops: int
    device: DeviceSpec
    limit_bytes: int                   # what ``fits`` compares with: budget, else usable memory
    knobs: Knobs
    trace_seconds: float
    basis: str = "cpu-trace"           # how the figures were obtained: cpu-trace | cuda-model
    notes: list[str] = field(default_factory=list)
    knobs_blocks: dict[str, Mode] = field(default_factory=dict)  # block -> mode applied
    # remat=True with a budget: DTR simulated on this step (memfit.trace.dtr_sim), else None
    remat_peak_bytes: int | None = None          # predicted live-bytes peak under DTR
    remat_recompute_flops: int | None = None     # forward FLOPs DTR reruns
    remat_floor_bytes: int | None = None         # the least budget the simulation reaches
    # per op of the timeline: FLOPs, bytes touched, of which training state, bytes allocated
    op_costs: list[tuple[int, int, int, int]] = field(default_factory=list)
    # category -> live bytes before the timeline's first op (the level it starts from)
    start_breakdown: dict[str, int] = field(default_factory=dict)
    # for a GPU: device_bytes line by line, and the driver's share of the card (trace.card)
    card: CardBreakdown | None = None
    lifetimes: StorageLog | None = field(default=None, compare=False, repr=False)  # memplan
    # "whole", "whole: why its blocks were not composed", or "composed from twins of ..."
    # (api._blockwise): the figures are the same either way
    traced_as: str = field(default="whole", compare=False)

    @property
    def device_bytes(self) -> int:
        """What the step holds on the device (nvidia-smi's per-process figure): reserved bytes
        plus what lives outside the allocator (``card.lines`` add up to it)."""
        return self.reserved_bytes + self.context_bytes

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.limit_bytes

    @property
    def headroom_bytes(self) -> int:
        """Bytes left under the limit (negative: how much is missing)."""
        return self.limit_bytes - self.device_bytes

    @property
    def validated(self) -> bool:
        """True when the figures are exact for the target (a CPU trace for a CPU target)."""
        return self.device.kind == "cpu"

    def block_report(self, name: str) -> dict:
        """One block under the traced knobs, and bounds on what the other options would cost:
        ``saved_bytes`` is what it keeps for backward now; recomputing it would keep only
        ``input_bytes`` and rerun at most ``recompute_flops_max`` (its forward FLOPs; less
        where checkpoint's early stop skips a trailing matmul, none of the matmuls under
        "selective"); offloading moves at most ``offload_bytes_max`` each way. ``bw_flops``
        includes what a recompute actually reran: compare with a plain estimate for the exact
        cost."""
        r = self.modules[name]
        return {"name": name, "mode": self.knobs_blocks.get(name, Mode.KEEP),
                "saved_bytes": r.saved_bytes, "input_bytes": r.input_bytes,
                "param_bytes": r.param_bytes, "fw_flops": r.fw_flops, "bw_flops": r.bw_flops,
                "recompute_flops_max": r.fw_flops, "offload_bytes_max": r.saved_bytes}

    def to_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "context_bytes": self.context_bytes,
            "device_bytes": self.device_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "breakdown": dict(self.breakdown),
            "fits": self.fits,
            "limit_bytes": self.limit_bytes,
            "headroom_bytes": self.headroom_bytes,
            "device": self.device.name,
            "precision": self.knobs.precision,
            "micro_batch_size": self.knobs.micro_batch_size,
            "fw_flops": self.fw_flops,
            "bw_flops": self.bw_flops,
            "basis": self.basis,
            "validated": self.validated,
            "notes": list(self.notes),
            "trace_seconds": round(self.trace_seconds, 3),
            "traced_as": self.traced_as,
            "blocks": [self.block_report(n) for n in self.blocks],
            "remat_peak_bytes": self.remat_peak_bytes,
            "remat_recompute_flops": self.remat_recompute_flops,
            "remat_floor_bytes": self.remat_floor_bytes,
            "card": self.card.to_dict() if self.card is not None else None,
            "cuda_version": ".".join(map(str, self.device.cuda_version))
            if self.device.cuda_version else None,
        }
