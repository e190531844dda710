"""``Plan``: the knobs chosen for a step, what memfit predicts for them, and why.

Note 1 (immutable). A Plan is what the search chose and predicted; nothing changes it later.
It is a frozen dataclass whose containers are read-only: ``blocks`` a ``MappingProxyType``,
``reasons`` a tuple of str, ``block_costs`` a tuple of read-only mappings (lists and dicts
given to the constructor are copied). Build it with everything in one call (``Plan(knobs,
blocks=..., reasons=[...])``) or derive another with ``dataclasses.replace``. What applying a
plan did (the modes each block got, a rebuilt optimizer, notes) is ``runner.applied``
(``memfit.runtime.Applied``), never written back here. ``to_json`` writes plain lists and
objects, and ``from_json`` reads versions 1 and 2 as before.

Note 2 (block modes). ``blocks`` maps each block to a ``memfit.Mode``, as does the "mode" of each
``block_costs`` entry: strings given to the constructor ("keep", "recompute+offload", ...) are
parsed (an unknown one is refused), and ``to_dict`` / ``to_json`` write the strings back, so the
JSON is what it was and ``from_json`` gives Mode members.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from memfit.knobs import Knobs
from memfit.modes import Mode
from memfit.planner._explain import explain
from memfit.planner.exports import export as _export

__all__ = ["Plan", "SCHEMA_VERSION"]

SCHEMA_VERSION = 2
_READS = (1, 2)          # versions from_json accepts (2 added fields with defaults)


@dataclass(frozen=True)
class Plan:
    """What a Runner runs (immutable: Note 1). Bytes are device bytes; ``None`` where nothing
    was predicted."""

    knobs: Knobs
    blocks: Mapping[str, Mode] = field(default_factory=dict)  # block name -> Mode (Note 2)
    predicted_peak_bytes: int | None = None       # allocated peak of one effective batch
    predicted_reserved_bytes: int | None = None   # what the allocator holds at that peak
    predicted_step_time_ratio: float | None = None  # vs the plain step at the user's precision
    device: str | None = None                     # DeviceSpec name planned for
    budget_bytes: int | None = None               # the budget planned against
    optimizer_rebuilt: bool = False               # the plan needs a new optimizer (see reasons);
    #                                               what a Runner did: runner.applied
    reasons: tuple[str, ...] = ()                 # why each choice, in words
    # bytes the optimizer step adds on top of what is live when it starts (its temporaries and,
    # on the first step, its state); the Runner checks it against the budget before stepping
    predicted_optimizer_step_bytes: int | None = None
    batch_size: int | None = None                 # the effective batch planned for (samples)
    floor_bytes: int | None = None                # the least device bytes any plan could reach
    #                                               (the model's floor, or the plan itself if lower)
    block_costs: tuple[Mapping, ...] = ()         # per block: mode, bytes saved, time
    predicted_device_bytes: int | None = None     # reserved + CUDA context: what the budget caps
    schema_version: int = SCHEMA_VERSION
    # the caching-allocator setting chosen (api._plan_allocator): scheme, expandable_segments,
    # saved_bytes (modelled, already off the predicted bytes); None: PyTorch's default
    allocator: Mapping | None = None

    def __post_init__(self):
        if not isinstance(self.knobs, Knobs):
            raise ValueError(f"Plan.knobs={self.knobs!r} must be a memfit.Knobs")
        if isinstance(self.reasons, str) or not all(isinstance(r, str) for r in self.reasons):
            raise ValueError(f"Plan.reasons={self.reasons!r} must be a sequence of str (one "
                             "reason each), e.g. reasons=['the plain step fits']")
        freeze = object.__setattr__                   # Note 1: read-only copies
        if self.knobs.offload_optimizer or self.knobs.precision == "bf16-pure" or \
                self.knobs.optimizer_state not in (None, "fp32") or \
                self.knobs.optimizer_in_backward:
            freeze(self, "optimizer_rebuilt", True)   # these knobs always need a new one
        freeze(self, "blocks", MappingProxyType({n: Mode.parse(m) for n, m in self.blocks.items()}))
        freeze(self, "reasons", tuple(self.reasons))
        freeze(self, "block_costs", tuple(MappingProxyType(_with_mode(c))
                                          for c in self.block_costs))
        if self.allocator is not None:
            freeze(self, "allocator", MappingProxyType(dict(self.allocator)))

    def to_dict(self) -> dict:
        """Plain lists and dicts (what ``to_json`` writes)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["knobs"] = self.knobs.to_dict()
        d["blocks"] = {n: m.value for n, m in self.blocks.items()}     # Note 2
        d["reasons"] = list(self.reasons)
        d["block_costs"] = [{**c, **({"mode": c["mode"].value} if "mode" in c else {})}
                            for c in self.block_costs]
        d["allocator"] = None if self.allocator is None else dict(self.allocator)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)      # the blocks in their order

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = json.loads(text)
        version = d.get("schema_version")
        if version not in _READS:
            raise ValueError(f"plan schema version {version!r} is not one this memfit reads "
                             f"({', '.join(map(str, _READS))}): re-plan with this version")
        d["schema_version"] = SCHEMA_VERSION
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The inverse of ``to_dict``."""
        d = dict(d)
        knobs = dict(d.pop("knobs"))
        for key in ("checkpoint", "offload"):       # JSON turns tuples into lists
            if isinstance(knobs.get(key), list):
                knobs[key] = tuple(knobs[key])
        return cls(knobs=Knobs(**knobs), **d)

    def __reduce__(self):          # copy, deepcopy and pickle (a mappingproxy does not pickle)
        return (type(self).from_dict, (self.to_dict(),))

    def explain(self) -> str:
        """The plan in words: global choices, predictions, a per-block table, and why."""
        return explain(self)

    def export(self, target: str, batch_size: int, world_size: int = 1):
        return _export(self, target, batch_size, world_size)   # -> Export(config, notes)


def _with_mode(cost: Mapping) -> dict:
    """A ``block_costs`` entry with its "mode" as a ``Mode`` (Note 2)."""
    out = dict(cost)
    if "mode" in out:
        out["mode"] = Mode.parse(out["mode"])
    return out
