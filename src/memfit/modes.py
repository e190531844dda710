"""``Mode``: what one block does with the activations it saves for backward, the one encoding.

The planner's choice per block (``Choice.modes``), a plan's ``Plan.blocks``, what applying a
plan did (``Applied.blocks``), the techniques' per-block resolution and the ``"name:selective"``
entries of a ``checkpoint`` tuple all speak ``Mode``. A ``Mode`` is a ``str`` (``Mode.KEEP ==
"keep"``, ``str(Mode.KEEP) == "keep"``), so JSON, tables and comparisons with the old strings
are unchanged; ``Mode.parse`` reads those strings and refuses anything else by name.
"""

from __future__ import annotations

import enum

__all__ = ["Mode"]


class Mode(str, enum.Enum):
    """One block's treatment of its saved activations.

    KEEP: saved as autograd saves them. RECOMPUTE: only the block's inputs are saved, its
    forward reruns in backward. SELECTIVE: recompute, keeping the outputs of the costly ops
    (matmuls, attention). OFFLOAD: saved tensors moved to host memory and back for backward.
    RECOMPUTE_OFFLOAD, SELECTIVE_OFFLOAD: recomputed, and what the recompute keeps offloaded
    (what applying a ``checkpoint`` and an ``offload`` that name the same block gives; the
    planner searches the first four).
    """

    KEEP = "keep"
    RECOMPUTE = "recompute"
    SELECTIVE = "selective"
    OFFLOAD = "offload"
    RECOMPUTE_OFFLOAD = "recompute+offload"
    SELECTIVE_OFFLOAD = "selective+offload"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value) -> "Mode":
        """``value`` (a Mode, or one of the strings ``"keep"``, ``"recompute"``, ...) as a Mode;
        anything else is a ``ValueError`` naming the valid ones."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"block mode {value!r} is not one of "
                         f"{', '.join(m.value for m in cls)}")

    @property
    def recomputes(self) -> bool:
        """The block's forward reruns in backward (fully or selectively)."""
        return self in (Mode.RECOMPUTE, Mode.SELECTIVE, Mode.RECOMPUTE_OFFLOAD,
                        Mode.SELECTIVE_OFFLOAD)

    @property
    def offloads(self) -> bool:
        """Some of what the block saves goes to host memory."""
        return self in (Mode.OFFLOAD, Mode.RECOMPUTE_OFFLOAD, Mode.SELECTIVE_OFFLOAD)

    def with_offload(self) -> "Mode":
        """This mode with its saved tensors offloaded as well."""
        return {Mode.KEEP: Mode.OFFLOAD, Mode.RECOMPUTE: Mode.RECOMPUTE_OFFLOAD,
                Mode.SELECTIVE: Mode.SELECTIVE_OFFLOAD}.get(self, self)
