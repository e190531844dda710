"""``export_traced``: a plan exported to a trainer, with what the export's own settings need.

An export cannot always do what the plan does (the Trainer keeps the optimizer state on the
device and clips by default; selective recompute becomes full recompute): ``Export.knobs`` are
memfit's knobs for what the export runs (planner.exports), and this re-traces exactly those,
so ``predicted_device_bytes`` is the export's memory, not the plan's. A note says when that
exceeds the plan's budget, by how much, and which lever the plan used that the export lacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from memfit.api.estimate import estimate
from memfit.planner import Plan
from memfit.planner.exports import Export, export
from memfit.units import format_bytes

__all__ = ["export_traced"]


def export_traced(plan: Plan, target: str, model: nn.Module, batch, *, optimizer="adamw",
                  batch_size: int | None = None, world_size: int = 1, device=None,
                  loss_fn: Callable | None = None, count_fn: Callable | None = None) -> Export:
    """``plan.export(target, ...)`` with ``predicted_device_bytes``: the export's settings
    re-traced on ``model`` and ``batch`` (the pair the plan was made for) with ``optimizer``
    (what the trainer will run). ``batch_size`` defaults to the plan's batch; ``device`` to the
    plan's device."""
    size = batch_size if batch_size is not None else plan.batch_size
    if size is None:
        raise ValueError("the plan records no batch size: pass batch_size= (samples per "
                         "optimizer step on one device)")
    out = export(plan, target, size, world_size)
    knobs = {n: v for n, v in out.knobs.to_dict().items() if v is not None}
    est = estimate(model, batch, optimizer, device if device is not None else plan.device,
                   loss_fn, count_fn=count_fn, **knobs)
    need = est.device_bytes
    notes = list(out.notes)
    budget = plan.budget_bytes
    if budget is not None and need > budget:
        lacks = " (the plan keeps the optimizer state on the host; this export cannot)" \
            if plan.knobs.offload_optimizer and not out.knobs.offload_optimizer else ""
        notes.append(f"memory: the exported settings need {format_bytes(need)} on the device "
                     f"(re-traced), {format_bytes(need - budget)} over the plan's budget of "
                     f"{format_bytes(budget)}{lacks}: the export alone may not fit")
    else:
        notes.append(f"memory: the exported settings need {format_bytes(need)} on the device "
                     "(re-traced)" + (f", within the plan's budget of {format_bytes(budget)}"
                                      if budget is not None else ""))
    return dataclasses.replace(out, notes=tuple(notes), predicted_device_bytes=need)
