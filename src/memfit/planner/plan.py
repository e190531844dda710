"""``Plan``: the knobs chosen for a step, what memfit predicts for them, and why."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from memfit.knobs import Knobs
from memfit.planner._explain import explain

__all__ = ["Plan", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2
_READS = (1, 2)          # versions from_json accepts (2 added fields with defaults)


@dataclass
class Plan:
    """What a Runner runs. Bytes are device bytes; ``None`` where nothing was predicted."""

    knobs: Knobs
    blocks: dict[str, str] = field(default_factory=dict)   # block name -> keep|recompute|...
    predicted_peak_bytes: int | None = None       # allocated peak of one effective batch
    predicted_reserved_bytes: int | None = None   # what the allocator holds at that peak
    predicted_step_time_ratio: float | None = None  # vs the plain step at the user's precision
    device: str | None = None                     # DeviceSpec name planned for
    budget_bytes: int | None = None               # the budget planned against
    optimizer_rebuilt: bool = False               # the Runner made a new optimizer (see reasons)
    reasons: list[str] = field(default_factory=list)  # why each choice, in words
    # bytes the optimizer step adds on top of what is live when it starts (its temporaries and,
    # on the first step, its state); the Runner checks it against the budget before stepping
    predicted_optimizer_step_bytes: int | None = None
    batch_size: int | None = None                 # the effective batch planned for (samples)
    floor_bytes: int | None = None                # the least device bytes any plan could reach
    #                                               (the model's floor, or the plan itself if lower)
    block_costs: list[dict] = field(default_factory=list)  # per block: mode, bytes saved, time
    predicted_device_bytes: int | None = None     # reserved + CUDA context: what the budget caps
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["knobs"] = self.knobs.to_dict()
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        version = d.get("schema_version")
        if version not in _READS:
            raise ValueError(f"plan schema version {version!r} is not one this memfit reads "
                             f"({', '.join(map(str, _READS))}): re-plan with this version")
        d["schema_version"] = SCHEMA_VERSION
        knobs = d.pop("knobs")
        for key in ("checkpoint", "offload"):       # JSON turns tuples into lists
            if isinstance(knobs.get(key), list):
                knobs[key] = tuple(knobs[key])
        return cls(knobs=Knobs(**knobs), **d)

    def explain(self) -> str:
        """The plan in words: global choices, predictions, a per-block table, and why."""
        return explain(self)

    def export(self, target: str, batch_size: int, world_size: int = 1):
        from memfit.planner.exports import export   # -> Export(config, notes); see exports.py
        return export(self, target, batch_size, world_size)
