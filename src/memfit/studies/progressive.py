"""``progressive``: a progressive sequence-length schedule (SEED.md Answer 2) that fits.

Note 1 (the schedule). "Train the first 90% of steps at a shorter input length, then the last
10% at full length with a smaller batch." Both phases train the same effective batch (the
optimizer sees the same number of samples per step); what shrinks in the long phase is the
micro-batch, which ``memfit.plan`` picks (with recompute or offload where cheaper) so the long
phase fits the same budget as the short one. Each phase is planned on its own batch: the
short one is the given batch with every tensor whose dim 1 is the full length cut to
``short_seq_len`` (cloned, so its storage is its own and counts only its bytes).

Note 2 (predicted time). ``plan.predicted_step_time_ratio`` is against the plain step *of that
phase's batch*. To put both phases on one scale, the two plain steps are traced once more for
their FLOPs (forward + backward) and step time is taken proportional to FLOPs between the two
lengths (the same model and batch size: the kernels are the same; only attention's L^2 terms
and the per-token work change). Then
``predicted_time_ratio = sum_i fraction_i * ratio_i * flops_i / flops_long``: the schedule's
mean step time over the plain step at full length. Short sequences on a GPU are often less
efficient per FLOP than long ones, so the saving this predicts is an upper bound.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map

from memfit.api.estimate import estimate
from memfit.api.plan import plan as plan_step
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.planner import Plan
from memfit.units import format_bytes

__all__ = ["Phase", "ProgressiveSchedule", "progressive", "sequence_length"]


@dataclass(frozen=True)
class Phase:
    """One phase of the schedule."""

    fraction: float            # share of the training steps run in this phase
    seq_len: int               # tokens per sample
    plan: Plan                 # memfit.plan for this phase's batch under the budget
    plain_flops: int = 0       # forward + backward FLOPs of the phase's plain step
    step_time_ratio: float = 1.0   # its planned step time / the long phase's plain step (Note 2)


@dataclass(frozen=True)
class ProgressiveSchedule:
    """Short phase(s) first, the full length last; each phase's plan fits the budget."""

    phases: tuple[Phase, ...]
    predicted_time_ratio: float    # mean step time / the plain step at full length (Note 2)

    def phase_at(self, step: int, total_steps: int) -> Phase:
        """The phase that step ``step`` (0-based) of ``total_steps`` runs in."""
        if total_steps < 1 or not 0 <= step < total_steps:
            raise ValueError(f"step {step} of {total_steps}: need 0 <= step < total_steps")
        end = 0.0
        for phase in self.phases:
            end += phase.fraction
            if step < round(end * total_steps):
                return phase
        return self.phases[-1]

    def explain(self) -> str:
        lines = [f"progressive sequence length: {len(self.phases)} phases, predicted mean step "
                 f"time {self.predicted_time_ratio:.2f}x the plain step at full length"]
        for i, p in enumerate(self.phases, 1):
            k = p.plan.knobs
            m, b = k.micro_batch_size or p.plan.batch_size, p.plan.batch_size
            lines.append(
                f"  phase {i}: {100 * p.fraction:g}% of steps at {p.seq_len} tokens, "
                f"{k.precision}, micro-batch {m} of {b}, checkpoint {k.checkpoint}, "
                f"offload {k.offload}, optimizer on host {bool(k.offload_optimizer)}: "
                f"{format_bytes(p.plan.predicted_device_bytes or 0)} of "
                f"{format_bytes(p.plan.budget_bytes or 0)}, step {p.step_time_ratio:.2f}x")
        lines.append("  (step times put on one scale by FLOPs between the two lengths: an "
                     "upper bound on the saving where short sequences use the GPU less well)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"predicted_time_ratio": self.predicted_time_ratio,
                "phases": [{"fraction": p.fraction, "seq_len": p.seq_len,
                            "plain_flops": p.plain_flops, "step_time_ratio": p.step_time_ratio,
                            "plan": p.plan.to_json()} for p in self.phases]}


def sequence_length(batch) -> int:
    """The batch's full length: dim 1 of ``input_ids``, else of its first tensor of 2+ dims."""
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].shape[1]
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return t.shape[1]
    raise ValueError("the batch has no tensor with a sequence dimension (dim 1): a progressive "
                     "schedule needs token inputs of shape (batch, length)")


def shorten(batch, full: int, short: int):
    """Every tensor whose dim 1 is ``full`` cut to ``short``, in storages of its own."""
    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == full:
            return t[:, :short].clone()
        return t
    return tree_map(cut, batch)


def progressive(model, batch, budget=None, *, short_seq_len: int, short_fraction: float = 0.9,
                device=None, optimizer="adamw", loss_fn: Callable | None = None,
                on_progress: Callable[[str], None] | None = None, **knobs) -> ProgressiveSchedule:
    """Plan a schedule: ``short_fraction`` of the steps at ``short_seq_len``, the rest at the
    batch's full length, both under ``budget`` (Note 1). Raises ``memfit.BudgetTooSmall`` naming
    the phase that cannot fit, ``ValueError`` for a fraction or length out of range."""
    say = on_progress or (lambda message: None)
    if isinstance(short_fraction, bool) or not isinstance(short_fraction, (int, float)) or \
            not 0 < short_fraction < 1:
        raise ValueError(f"short_fraction must be between 0 and 1 (exclusive), got "
                         f"{short_fraction!r}: e.g. 0.9 for 90% of the steps at the short length")
    full = sequence_length(batch)
    if isinstance(short_seq_len, bool) or not isinstance(short_seq_len, int) or \
            not 0 < short_seq_len < full:
        raise ValueError(f"short_seq_len must be an int in 1..{full - 1} (below the batch's "
                         f"length {full}), got {short_seq_len!r}")
    Knobs.from_kwargs(**knobs)                  # unknown knobs refused before any trace
    parts = [(short_fraction, short_seq_len, shorten(batch, full, short_seq_len), "short"),
             (1 - short_fraction, full, batch, "long")]
    user = knobs.get("precision")
    flops_precision = user if user not in (None, "auto") else "fp32"
    planned = []
    for fraction, L, b, name in parts:
        say(f"planning the {name} phase ({L} tokens)")
        try:
            p = plan_step(model, b, budget, optimizer=optimizer, device=device, loss_fn=loss_fn,
                          on_progress=on_progress, **knobs)
        except BudgetTooSmall as e:
            raise BudgetTooSmall(f"the {name} phase ({L} tokens) cannot fit: {e}",
                                 floor_bytes=e.floor_bytes, budget_bytes=e.budget_bytes) from e
        say(f"counting the FLOPs of the {name} phase's plain step")
        est = estimate(model, b, optimizer, device, loss_fn, precision=flops_precision,
                       allocator_replay=False)
        planned.append((fraction, L, p, est.fw_flops + est.bw_flops))
    long_flops = planned[-1][3]
    phases = tuple(Phase(f, L, p, flops, p.predicted_step_time_ratio * flops / long_flops)
                   for f, L, p, flops in planned)
    ratio = sum(ph.fraction * ph.step_time_ratio for ph in phases)
    return ProgressiveSchedule(phases, ratio)
