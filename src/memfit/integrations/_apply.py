"""A ``memfit.Plan`` applied to a model and optimizer that a framework's own loop runs.

Note 1 (what is applied, and how). A plan made for a user step (``memfit.plan(step=fn)``: only
per-block modes and the optimizer's placement are planned for one) reaches the loop through the
model and the optimizer only: the plan's knobs are applied by the same ``api._setup.build_runner``
that ``estimate`` traced (checkpoint hooks, offload hooks on the blocks,
``techniques.optimizer_offload`` around the user's optimizer), on the real model, and the Runner it
builds is not used to train: the framework's loop is. A rebuilt optimizer (offloaded state) is
handed to ``swap(new) -> undo``, which puts it where the loop finds it (inside accelerate's wrapper;
in Lightning's strategy). Nothing on the model is replaced; ``Changes.remove`` takes the hooks off
and puts the optimizer back.

Note 2 (values). Recompute and offload replay the same ops on the same values (RNG state
included), and the offloaded optimizer steps fp32 copies with the same class: losses and weights
are bitwise those of the unplanned loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from memfit.api._setup import build_runner
from memfit.modes import Mode
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.units import format_bytes

__all__ = ["Changes", "apply_plan"]


@dataclass
class Changes:
    """What applying a plan changed on the model and the optimizer (Note 1)."""

    plan: Plan
    blocks: dict[str, Mode]                # block -> mode installed by hooks
    optimizer_offloaded: bool              # the optimizer's state and step live on the host
    predicted_peak_bytes: int              # allocated peak of the planned step (the trace)
    predicted_device_bytes: int            # what the budget is checked against
    budget_bytes: int
    notes: list[str] = field(default_factory=list)
    _undo: list = field(default_factory=list, repr=False)

    @property
    def changed(self) -> bool:
        return self.optimizer_offloaded or any(m != Mode.KEEP for m in self.blocks.values())

    def __str__(self) -> str:
        head = (f"memfit: {format_bytes(self.predicted_device_bytes)} predicted under the "
                f"budget {format_bytes(self.budget_bytes)}")
        if not self.changed:
            return "\n".join([head + "; nothing changed"] + [f"  {n}" for n in self.notes])
        lines = [head, f"  predicted step time x{self.plan.predicted_step_time_ratio:.2f}"]
        hooked = sorted({m for m in self.blocks.values() if m != Mode.KEEP})
        if hooked:
            n = sum(m != Mode.KEEP for m in self.blocks.values())
            lines.append(f"  block hooks: {n} of {len(self.blocks)} blocks {'/'.join(hooked)}")
        if self.optimizer_offloaded:
            lines.append("  optimizer: memfit's OffloadedOptimizer (state and step on the host)")
        return "\n".join(lines + [f"  {n}" for n in self.notes])

    def remove(self) -> None:
        """Undo: hooks off, the optimizer back as it was."""
        while self._undo:
            self._undo.pop()()


def apply_plan(plan: Plan, model: nn.Module, optimizer, budget_bytes: int,
               swap: Callable[[object], Callable[[], None]]) -> Changes:
    """Apply ``plan``'s block modes and optimizer placement to ``model`` / ``optimizer`` in
    place (Note 1); ``swap(new)`` installs a rebuilt optimizer and returns its undo."""
    runner = build_runner(model, OptimizerRecipe(optimizer), plan.knobs, plan=plan)
    undo = [runner.close]
    try:
        offloaded = runner.optimizer is not optimizer
        if offloaded:
            undo.append(swap(runner.optimizer))
    except BaseException:
        while undo:
            undo.pop()()
        raise
    return Changes(plan=plan, blocks=dict(runner.applied.blocks), optimizer_offloaded=offloaded,
                   predicted_peak_bytes=plan.predicted_peak_bytes,
                   predicted_device_bytes=plan.predicted_device_bytes,
                   budget_bytes=budget_bytes, notes=list(plan.reasons), _undo=undo)
