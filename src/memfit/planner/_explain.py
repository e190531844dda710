"""``Plan.explain()``: the plan in words: global choices, predictions, a per-block table, why."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.modes import Mode
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.planner.plan import Plan

__all__ = ["explain", "ratio_words", "accumulated_words"]


def ratio_words(r: float) -> str:
    """A step-time ratio in words, against the user's own step (the plain step at their precision):
    below 1 a speed-up (a plan that changes the precision or the optimizer implementation can
    be faster than the step it replaces; its reasons say which)."""
    kind = "a speed-up" if r < 0.995 else "a slowdown" if r > 1.005 else "the same time"
    return f"{r:.2f}x the plain step at your precision ({kind})"


def explain(plan: "Plan") -> str:
    k = plan.knobs
    lines = [f"memfit plan for {plan.device or 'the device'}"
             + (f", budget {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else "")]
    lines.append("  " + " · ".join(_globals(plan)))
    if plan.predicted_peak_bytes is not None:
        lines.append(f"  predicted: peak {format_bytes(plan.predicted_peak_bytes)} allocated, "
                     f"{format_bytes(plan.predicted_reserved_bytes or plan.predicted_peak_bytes)}"
                     " held by the allocator"
                     + (f", {format_bytes(plan.predicted_device_bytes)} on the device"
                        if plan.predicted_device_bytes is not None else ""))
    host = getattr(plan, "predicted_host_bytes", None)
    if host and _offloads(plan):
        lines.append(f"  host RAM needed by the offload: {format_bytes(host)} (offloaded "
                     "activations and optimizer state)")
    if plan.predicted_step_time_ratio is not None:
        lines.append(f"  predicted step time: {ratio_words(plan.predicted_step_time_ratio)}")
    if plan.floor_bytes is not None:
        lines.append(f"  floor (the least any plan needs): {format_bytes(plan.floor_bytes)}")
    if plan.block_costs:
        lines.append("  blocks:")
        lines += ["    " + row for row in _block_rows(plan.block_costs)]
    elif plan.blocks:
        lines.append("  blocks: " + ", ".join(f"{n} {m}" for n, m in plan.blocks.items()))
    if k.remat:
        lines.append("  remat: DTR evicts and recomputes saved tensors under the budget")
    if plan.reasons:
        lines.append("  why:")
        lines += [f"    - {r}" for r in plan.reasons]
    return "\n".join(lines)


def _offloads(plan: "Plan") -> bool:
    """The plan moves something to the host (else host bytes are no offload's)."""
    k = plan.knobs
    return bool(k.offload_optimizer) or k.offload not in (None, "none") or \
        any(m.offloads for m in plan.blocks.values())


def _globals(plan: "Plan") -> list[str]:
    k = plan.knobs
    b, m = plan.batch_size, k.micro_batch_size
    if k.precision is None and m is None:       # planned for the user's step=fn: its own
        out = ["precision and micro-batches: the step's own"]
    else:
        out = [f"precision {k.precision or 'fp32'}" if not getattr(k, "mp_policy", None) else
               f"precision {k.mp_policy} compute, fp32 sharded weights (FSDP2 "
               "MixedPrecisionPolicy)"]
        if b and m and m < b:
            out.append(f"{accumulated_words(b, m)} (batch {b})")
        elif b:
            out.append(f"batch {b} in one micro-batch")
    if getattr(k, "fsdp_offload", None):
        out.append("sharded weights, gradients and optimizer state on the host (FSDP2 CPU "
                   "offload)")
    else:
        out.append("optimizer state on the host" if k.offload_optimizer else
                   "optimizer state on the device")
    if k.optimizer_state not in (None, "fp32"):
        out.append(f"{k.optimizer_state} optimizer state (changes the numerics)")
    if k.offload_params not in (None, "none"):
        out.append(f"block weights on the host ({k.offload_params})")
    if getattr(k, "chunked_loss", None):
        out.append(f"loss in {k.chunked_loss} pieces (chunked_loss)")
    if getattr(k, "quantize_base", None) not in (None, "none"):
        out.append(f"frozen linear weights in {k.quantize_base} by bitsandbytes (quantize_base; "
                   "changes the numerics)")
    if getattr(k, "optimizer_in_backward", None):
        out.append("optimizer stepped in backward, one parameter at a time (optimizer_in_backward)")
    if getattr(k, "offload_gradients", None):
        out.append("gradients to the host as backward makes them (offload_gradients)")
    impl = getattr(k, "optimizer_impl", None)
    if impl and not k.offload_optimizer:
        out.append(f"{impl} optimizer")
    if k.max_grad_norm is not None:
        out.append(f"clip at {k.max_grad_norm}")
    return out


def _block_rows(costs: list[dict]) -> list[str]:
    """One row per run of consecutive blocks with the same mode."""
    runs: list[list[dict]] = []
    for c in costs:
        if runs and runs[-1][0]["mode"] == c["mode"]:
            runs[-1].append(c)
        else:
            runs.append([c])
    width = max(len(_names(r)) for r in runs)
    rows = [f"{'block(s)':<{width}}  {'mode':<10} {'saves (each)':>13} {'time (each)':>12}"]
    for r in runs:
        c = r[0]
        saved = format_bytes(c["saved_bytes"]) if c["mode"] != Mode.KEEP else "-"
        paid = f"+{1e3 * c['time_s']:.1f} ms" if c["mode"] != Mode.KEEP else "-"
        rows.append(f"{_names(r):<{width}}  {c['mode']:<10} {saved:>13} {paid:>12}")
    return rows


def _names(run: list[dict]) -> str:
    if len(run) == 1:
        return run[0]["name"]
    return f"{run[0]['name']} .. {run[-1]['name'].rsplit('.', 1)[-1]} ({len(run)})"


def accumulated_words(b: int, m: int) -> str:
    """A batch of ``b`` in micro-batches of ``m``, as accumulation splits it: "micro-batch 3 x
    10 + 2 accumulated" where the last one is short (it printed 3 x 11 for 32)."""
    n, rest = divmod(b, m)
    return f"micro-batch {m} x {n}" + (f" + {rest}" if rest else "") + " accumulated"
