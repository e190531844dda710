"""The one ``Plan`` builder: a searched configuration and the trace that verified it -> ``Plan``.

Every planner (one device, the sharded layouts, the Hugging Face Trainer's) ends here, so a
plan's figures mean the same wherever it was made: its predicted peak, reserved and device
bytes are the verifying trace's (plus the bytes held beside the step, the caller's batch), its
optimizer-step rise is read off that trace, and its per-block costs come from the memory and
time models the search used.
"""

from __future__ import annotations

from collections.abc import Sequence

from memfit.knobs import Knobs
from memfit.planner._trace_reads import optimizer_rise_bytes
from memfit.planner.memory_model import MemoryModel
from memfit.planner.plan import Plan
from memfit.planner.time_model import TimeModel

__all__ = ["build_plan", "block_costs"]


def block_costs(memory: MemoryModel, time: TimeModel, modes: Sequence, m: int,
                b: int) -> list[dict]:
    """Per block: its mode, the saved bytes it holds at micro-batch ``m`` and its seconds per
    effective batch of ``b`` (the models' figures)."""
    n = -(-b // m)
    return [{"name": name, "mode": mode, "saved_bytes": int(memory.held_saved_bytes(i, mode, m)),
             "time_s": time.mode_s(i, mode, m, n, b)}
            for i, (name, mode) in enumerate(zip(memory.blocks, modes))]


def build_plan(knobs: Knobs, blocks: Sequence[str], modes: Sequence, verified, *,
               batch_size: int, ratio: float | None, device: str, budget_bytes: int | None,
               reasons: Sequence[str], held_bytes: int = 0, device_bytes: int | None = None,
               floor_bytes: int | None = None, costs: Sequence[dict] = ()) -> Plan:
    """The plan of ``knobs`` with per-block ``modes``, as ``verified`` (its trace) found it.
    ``device_bytes``: what the budget caps, where the caller counts the card itself (default:
    the trace's device bytes plus ``held_bytes``); ``floor_bytes`` is kept at most that."""
    device_bytes = verified.device_bytes + held_bytes if device_bytes is None else device_bytes
    return Plan(knobs, blocks=dict(zip(blocks, modes)),
                predicted_peak_bytes=verified.peak_bytes + held_bytes,
                predicted_reserved_bytes=verified.reserved_bytes + held_bytes,
                predicted_device_bytes=device_bytes, predicted_step_time_ratio=ratio,
                device=device, budget_bytes=budget_bytes,
                predicted_optimizer_step_bytes=optimizer_rise_bytes(verified),
                batch_size=batch_size,
                floor_bytes=None if floor_bytes is None else min(floor_bytes, device_bytes),
                block_costs=list(costs), reasons=list(reasons))
