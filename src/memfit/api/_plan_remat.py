"""DTR in the planner (``api.plan``): fixed by the caller, or weighed against the static
plan over the workload's batches (planner.remat_choice); and ``Planned``, a plan with
the traces behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from memfit.api.estimate import Estimate, estimate
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.measure import storages_of
from memfit.planner import Plan
from memfit.planner._trace_reads import optimizer_rise_bytes
from memfit.planner.remat_choice import MARGIN, remat_on, remat_plan, static_seconds
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.precision import Precision
from memfit.units import format_bytes

__all__ = ["Planned", "RematWeigh", "check_remat", "held_bytes", "weigh"]


@dataclass
class Planned:
    """A plan with the traces behind it: the plain step (at the plan's precision, the whole
    batch in one micro-batch) and the step with the plan applied (its re-trace)."""

    plan: Plan
    plain: Estimate
    chosen: Estimate
    step_s: float | None = None     # the plan's predicted step (time_model), where searched


def held_bytes(batch, precision: str) -> int:
    """Bytes of the caller's batch the step does not use but ``runner.step(batch)`` keeps alive
    beside it (``api._planner``: the caller's batch): an all-ones mask that is dropped,
    bf16-pure's fp32 originals."""
    used = Precision(Precision.Config(precision)).prepare_batch(prepare_batch(batch))
    kept = {st._cdata for t in tree_leaves(used) if isinstance(t, torch.Tensor)
            for st in storages_of(t)}
    seen, total = set(), 0
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            for st in storages_of(t):
                if st._cdata not in kept and st._cdata not in seen:
                    seen.add(st._cdata)
                    total += st.nbytes()
    return total


def check_remat(k: Knobs, step) -> None:
    """DTR fixed by the caller plans the whole batch with nothing else fixed but the
    optimizer's placement (planner.remat_choice)."""
    if not k.remat:
        return
    if step is not None:
        raise ValueError("remat=True with step=fn: DTR is not planned for a user step yet; "
                         "use memfit.fit(..., step=fn, budget=..., remat=True)")
    fixed = [n for n in ("micro_batch_size", "checkpoint", "offload", "offload_params")
             if getattr(k, n) not in (None, "none")]
    if fixed:
        raise ValueError(f"remat=True with {', '.join(fixed)} fixed: DTR runs the whole batch "
                         "and evicts what the budget needs, so a static choice beside it is "
                         f"not planned; leave {', '.join(fixed)} unset (memfit then weighs "
                         "DTR against static plans with remat unset)")


class RematWeigh:
    """DTR over the workload (planner.remat_choice): traced once, on demand."""

    def __init__(self, model, batch, batches, plain, common, spec, user, b, budget_bytes,
                 state, k: Knobs, say):
        self.model, self.batch, self.batches, self.plain = model, batch, batches, plain
        self.common, self.spec, self.user, self.b = common, spec, user, b
        self.budget_bytes, self.state, self.k, self.say = budget_bytes, state, k, say
        self._rows = None

    def _knobs(self) -> dict:
        return dict(self.state, offload_optimizer=bool(self.k.offload_optimizer))

    def rows(self):
        """Per workload batch: (RematBatch, held bytes)."""
        if self._rows is None:
            out, seen = [], {}
            work = [None] if self.batches is None else list(self.batches)
            for i, given in enumerate(work):
                w = self.batch if given is None else prepare_batch(given)
                if id(given) in seen:          # the same batch again: traced once
                    out.append(seen[id(given)])
                    continue
                if given is None and not self.k.offload_optimizer:
                    est = self.plain
                else:
                    self.say(f"tracing the plain step for DTR (workload batch {i + 1} of "
                             f"{len(work)})")
                    est = estimate(self.model, w, precision=self.user,
                                   optimizer_impl=self.k.optimizer_impl, **self._knobs(),
                                   **self.common)
                held = held_bytes(w, self.user)
                ratio = est.reserved_bytes / max(est.peak_bytes, 1)
                cap = int((self.budget_bytes - est.context_bytes) / ratio) - held
                out.append((remat_on(est, self.spec, self.user, batch_size_of(w), cap), held,
                            ratio, est))
                seen[id(given)] = out[-1]
            self._rows = out
        return self._rows

    def plan(self, reasons: list[str]) -> Plan:
        rows = self.rows()
        est = rows[0][3]
        k = self.k.replace(remat=True, precision=self.user, micro_batch_size=self.b,
                           checkpoint="none", offload="none",
                           offload_optimizer=bool(self.k.offload_optimizer))
        return remat_plan(k, [r[0] for r in rows], device=self.spec.name,
                          budget_bytes=self.budget_bytes, b=self.b,
                          held_bytes=max(r[1] for r in rows),
                          device_ratio=max(r[2] for r in rows), context_bytes=est.context_bytes,
                          reasons=reasons, optimizer_step_bytes=optimizer_rise_bytes(est))

    def fixed(self, plain) -> Planned:
        """remat=True: the DTR plan, or ``BudgetTooSmall`` with DTR's floor."""
        rows = self.rows()
        if not all(r[0].fits for r in rows):
            worst = max(rows, key=lambda r: r[0].floor_bytes)
            floor = int(worst[0].floor_bytes * worst[2]) + worst[1] + worst[3].context_bytes
            raise BudgetTooSmall(
                f"DTR cannot keep {format_bytes(self.budget_bytes)}: with every block's saved "
                f"tensors evicted the step still needs {format_bytes(floor)} (what is alive "
                "outside the blocks, and the optimizer step). Plan without remat=True to weigh "
                "the static levers (micro-batches, offload, optimizer state on the host), or "
                "raise the budget", floor_bytes=floor, budget_bytes=self.budget_bytes)
        p = self.plan(["remat=True (as you set it): DTR evicts blocks' saved tensors when the "
                       "budget is reached and recomputes them when backward needs them; "
                       f"predicted {sum(r[0].evictions for r in rows)} eviction(s) over "
                       f"{len(rows)} batch(es)"])
        return Planned(p, plain, plain)

    def faster_than(self, static: Plan) -> Plan | None:
        """The DTR plan where it is predicted faster than ``static`` over the workload."""
        if len({_shapes(w) for w in (self.batches or [self.batch])}) < 2:
            return None            # one batch: the static search spans DTR's choices (api._planner)
        rows = self.rows()
        if not all(r[0].fits for r in rows):
            return None
        batches = [r[0] for r in rows]
        static_s = static_seconds(static.predicted_step_time_ratio, batches)
        remat_s = sum(r.remat_s for r in batches)
        if remat_s >= static_s * (1 - MARGIN):
            return None
        n = len(batches)
        return self.plan([
            f"DTR (remat) over the {n} workload batch(es): predicted {remat_s / static_s:.2f}x "
            f"the time of the best static plan ({static.predicted_step_time_ratio:.2f}x the "
            "plain step on every batch), because DTR evicts and recomputes only on the "
            f"batches over the budget ({sum(r.evictions > 0 for r in batches)} of {n}); the "
            "numerics do not change (recompute is bitwise)"])


def _shapes(batch) -> tuple:
    """The shapes of a batch's tensors (what makes two workload batches differ for DTR)."""
    return tuple(tuple(t.shape) for t in tree_leaves(batch) if isinstance(t, torch.Tensor))


def weigh(remat: RematWeigh | None, planned: Planned) -> Planned:
    """The static plan, or DTR where it is predicted faster (planner.remat_choice)."""
    if remat is None:
        return planned
    dtr = remat.faster_than(planned.plan)
    return planned if dtr is None else Planned(dtr, planned.plain, planned.plain)
