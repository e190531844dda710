"""What a ledger knows of the step before the one it counted (``trace.first_step``).

A trace for a GPU target counts a steady-state step, but the caching allocator's replay needs
the first step's history too. ``trace.first_step`` can make that first step from the counted
one instead of tracing it; a ``FirstStep`` holds what it needs and what it made:

- ``made``: the storages alive before the counted step that the first step makes, each with
  the tag of the mark (``Tracker.first_step_mark``) where it makes them (optimizer state at its
  ``_init_group``, a GradScaler's scale and growth tracker at its first ``scale``);
- ``older``: optimizer storages made before any step (master weights), and ``late``, those
  of them that a traced first step finds only when its optimizer step reads them
  (bitsandbytes' quantization maps, held by the state): not the first step's to make;
- ``grads``: each gradient alive before the counted step, with the gradient the counted step
  makes for the same parameter (the first step makes the former where the counted step makes
  the latter);
- ``events``: once made, the first step's events on the device and the host, (storage id,
  +/- bytes, is a resize), which ``Ledger.device_events`` puts between the entry storages and
  the counted step's own events; ``op_events``: how many of them came before the end of each
  of its ops (the counted step's ops, one for one), so that a replay reads the phase each was
  made in as it reads a traced first step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FirstStep"]


@dataclass
class FirstStep:
    made: dict[int, str] = field(default_factory=dict)     # entry sid -> tag of its mark
    grads: dict[int, int] = field(default_factory=dict)    # entry grad sid -> the step's own
    older: set[int] = field(default_factory=set)           # optimizer storages before step 1
    late: set[int] = field(default_factory=set)            # of them, found by its optimizer step
    events: list[tuple[int, int, bool]] | None = None      # (sid, +/- bytes, resize)
    op_events: list[int] = field(default_factory=list)     # its events after each of its ops

    @property
    def length(self) -> int:
        """Events the first step adds before the counted step's (0 when not made)."""
        return 0 if self.events is None else len(self.events)
