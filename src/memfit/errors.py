"""memfit's own error types. Each message gives the numbers and the next step."""

from __future__ import annotations

import torch

from memfit.units import format_bytes

__all__ = ["OutOfMemory", "BudgetTooSmall", "TraceError", "MemfitError", "ReplanError",
           "MemfitDeprecationWarning"]


class MemfitError(Exception):
    """Base class for memfit errors that are not also a builtin kind."""


class OutOfMemory(torch.OutOfMemoryError):
    """An op would have crossed the byte budget; it had no effect (its outputs were dropped).

    Attributes (all in bytes): ``requested_bytes`` (new storage the op would allocate),
    ``live_bytes`` (live before the op), ``budget_bytes``; ``op`` (the aten op) and
    ``module`` (qualified name of the innermost module running it, or ``None``).
    """

    def __init__(self, *, requested_bytes: int, live_bytes: int, budget_bytes: int, op: str,
                 module: str | None = None):
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.budget_bytes = budget_bytes
        self.op = op
        self.module = module
        where = f" in module '{module}'" if module else ""
        super().__init__(
            f"memfit: out of memory at {op}{where}: it requests {format_bytes(requested_bytes)} "
            f"({requested_bytes} B) with {format_bytes(live_bytes)} ({live_bytes} B) live, "
            f"budget {format_bytes(budget_bytes)} ({budget_bytes} B). Try a smaller batch or "
            "sequence length, a lower precision, or a larger budget."
        )


class BudgetTooSmall(ValueError):
    """No configuration in reach fits the budget; ``floor_bytes`` is the least that would.
    ``floor_is_bound``: True where the budget was refused before any trace, under a lower bound
    of the floor from the parameters alone (weights, gradients, optimizer state): the floor is
    then at least ``floor_bytes``."""

    def __init__(self, message: str, *, floor_bytes: int, budget_bytes: int,
                 floor_is_bound: bool = False):
        self.floor_bytes = floor_bytes
        self.budget_bytes = budget_bytes
        self.floor_is_bound = floor_is_bound
        super().__init__(message)


class TraceError(MemfitError, RuntimeError):
    """The symbolic (fake-tensor) trace could not run an op; names the op and the module."""

    def __init__(self, message: str, *, op: str | None = None, module: str | None = None):
        self.op = op
        self.module = module
        super().__init__(message)


class ReplanError(MemfitError, RuntimeError):
    """Re-planning across the ranks of a job failed: rank 0's planning, or sharing its plan.
    ``waited_on`` is the rank this one was waiting on when gloo failed (None: unknown or not a
    broadcast failure)."""

    def __init__(self, message: str, *, waited_on: int | None = None):
        self.waited_on = waited_on
        super().__init__(message)


class MemfitDeprecationWarning(DeprecationWarning):
    """A memfit call in a form that goes away in the next release; the message gives the new
    form. Its own class, so a test suite or an application can filter memfit's alone
    (``-W ignore::memfit.errors.MemfitDeprecationWarning``)."""
