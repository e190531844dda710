"""``Knobs``: the choices memfit can make for a training step (one dataclass for every front)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Knobs", "PRECISIONS"]

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure", "auto")


@dataclass(frozen=True)
class Knobs:
    """A keyword fixes a choice; ``None`` leaves it to memfit.

    precision: "fp32" (the user's numerics, the API default), "fp16" (autocast with loss
        scaling), "bf16" (autocast), "bf16-pure" (bf16 weights, fp32 master weights held for
        the optimizer) or "auto" (memfit may pick; the CLI's default).
    """

    precision: str | None = None

    def __post_init__(self):
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs) -> "Knobs":
        """Build from keyword arguments; an unknown keyword names the valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(
                f"unknown knob(s) {', '.join(unknown)}; valid knobs: {', '.join(names)}"
            )
        return cls(**kwargs)
