"""``Applied``: what building a Runner did to the user's model and optimizer.

A ``Plan`` is what the search chose and predicted, and stays as it was (a frozen record); the
Runner keeps it as ``runner.plan`` and records here what applying it changed: the mode each
block actually got (checkpoint and offload hooks as applied, e.g. ``Mode.RECOMPUTE_OFFLOAD``),
whether the optimizer was rebuilt, the budget the Runner enforces and notes in words.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from memfit.modes import Mode

__all__ = ["Applied"]


@dataclass(frozen=True)
class Applied:
    """What applying a plan did (read-only: a new record replaces it, e.g. after a re-plan)."""

    # block name -> Mode (strings are parsed), as the blocks' hooks were installed (blocks in
    # execution order)
    blocks: Mapping[str, Mode] = field(default_factory=dict)
    optimizer_rebuilt: bool = False   # runner.optimizer is a new optimizer, not the one passed in
    budget_bytes: int | None = None   # device bytes the Runner holds the optimizer step to
    notes: tuple[str, ...] = ()       # what was done and why, in words

    def __post_init__(self):
        if isinstance(self.notes, str) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError(f"Applied.notes={self.notes!r} must be a sequence of str")
        object.__setattr__(self, "blocks",
                           MappingProxyType({n: Mode.parse(m) for n, m in self.blocks.items()}))
        object.__setattr__(self, "notes", tuple(self.notes))

    def with_note(self, note: str) -> "Applied":
        """This record with one more note."""
        return dataclasses.replace(self, notes=(*self.notes, note))

    def __reduce__(self):          # copy, deepcopy and pickle (a mappingproxy does not pickle)
        return (type(self), (dict(self.blocks), self.optimizer_rebuilt, self.budget_bytes,
                             self.notes))
