"""``Change``: what a technique's ``apply`` changed, the one return type of every technique.

Note 1 (the protocol). A technique is one class with a nested frozen ``Config`` dataclass and
``apply(model, ...) -> Change``. What ``apply`` takes after the model is the technique's own (an
optimizer, an ``OptimizerRecipe``, a mesh); what it returns is always a ``Change`` that says, as
far as the technique has them: the model to train (the one passed in, or a wrapper), the
optimizer to step (when ``apply`` built or rebuilt one) or the recipe it is to be built from
(when ``apply`` changed how it is built), the per-block ``Mode`` it set for the blocks' saved
activations, notes for the user, live counters, the context each effective batch runs inside,
and the hooks it registered. A caller (``api._setup.build_runner``) strings techniques together
by reading these fields, never a technique's own handle type.

Note 2 (remove and reapply). ``remove()`` takes off every hook ``apply`` registered, then runs
the technique's own undo of what the hooks moved (parameter offload fetches every weight back
to the device), so the model's forward is again the one it had before ``apply``. What ``apply``
changed in place is not undone: bf16-pure's cast of the weights, FSDP's sharding, and a
rebuilt optimizer stays the one to step. ``remove()`` may be called twice. ``reapply()`` applies
the same technique again after ``remove()`` (same blocks, config and copies: the OOM guard puts
a runner's techniques back this way) and returns the new ``Change``; a change that registered
nothing returns itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from torch import nn

from memfit.modes import Mode
from memfit.optimizers import OptimizerRecipe

__all__ = ["Change"]


@dataclass(frozen=True, eq=False)
class Change:
    """What one technique's ``apply`` changed (Note 1); ``remove()`` undoes its hooks (Note 2)."""

    model: nn.Module                   # the model to train: the one passed in, or a wrapper
    optimizer: object | None = None    # the optimizer to step from now on; None: apply built none
    optimizer_rebuilt: bool = False    # the optimizer is not the one passed in (or will not be)
    # the recipe to build the optimizer from, when apply changed how it is built (low-bit state)
    recipe: OptimizerRecipe | None = None
    # block name -> Mode apply set for the block's saved activations, blocks in execution order
    modes: Mapping[str, Mode] = field(default_factory=dict)
    notes: tuple[str, ...] = ()        # what apply did and why, in words for the user
    stats: object | None = None        # live counters since apply (offload's), else None
    # () -> a context manager each effective batch runs inside (remat's session); None: none
    context: Callable[[], AbstractContextManager] | None = None
    hooks: tuple = ()                  # the RemovableHandles apply registered
    on_remove: Callable[[], None] | None = field(default=None, repr=False)  # after the hooks go
    redo: Callable[[], "Change"] | None = field(default=None, repr=False)    # reapply()

    def __post_init__(self):
        if isinstance(self.notes, str) or not all(isinstance(n, str) for n in self.notes):
            raise ValueError(f"Change.notes={self.notes!r} must be a sequence of str")
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "hooks", tuple(self.hooks))
        object.__setattr__(self, "modes", {n: Mode.parse(m) for n, m in self.modes.items()})

    def remove(self) -> None:
        """Take off the hooks ``apply`` registered, then undo what they moved (Note 2)."""
        for h in reversed(self.hooks):
            h.remove()
        if self.on_remove is not None:
            self.on_remove()

    def reapply(self) -> "Change":
        """The same technique applied again, after ``remove()`` (Note 2)."""
        return self if self.redo is None else self.redo()
