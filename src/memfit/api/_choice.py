"""A searched ``Choice`` as the knobs that apply it, and in words."""

from __future__ import annotations

from memfit.knobs import Knobs
from memfit.modes import Mode
from memfit.planner.choice import Choice

__all__ = ["knob_values", "describe"]


def knob_values(choice: Choice, blocks: list[str], k: Knobs | None = None) -> dict:
    """The Knobs that apply ``choice`` (per-block modes as policies or tuples of names); the
    caller's own ``checkpoint`` / ``offload`` where they fixed it (it may name modules that
    are not blocks, or recompute and offload one block, which the search only mirrors)."""
    def policy(kinds: dict[str, Mode]) -> str | tuple[str, ...]:
        if not kinds:
            return "none"
        if len(kinds) == len(blocks) and len(set(kinds.values())) == 1:
            return "selective" if Mode.SELECTIVE in kinds.values() else "all"
        # the policy language's one suffix: "name:selective" (techniques._blocks)
        return tuple(f"{n}:{Mode.SELECTIVE.value}" if v == Mode.SELECTIVE else n
                     for n, v in kinds.items())

    recompute = {n: m for n, m in zip(blocks, choice.modes)
                 if m in (Mode.RECOMPUTE, Mode.SELECTIVE)}
    offload = {n: m for n, m in zip(blocks, choice.modes) if m == Mode.OFFLOAD}
    out = dict(micro_batch_size=choice.micro_batch_size, checkpoint=policy(recompute),
               offload=policy(offload), offload_optimizer=choice.offload_optimizer,
               optimizer_impl=choice.optimizer_impl,
               optimizer_state=choice.optimizer_state or (k.optimizer_state if k else None),
               offload_params=choice.offload_params or (k.offload_params if k else None),
               chunked_loss=choice.chunked_loss or (k.chunked_loss if k else None),
               optimizer_in_backward=choice.optimizer_in_backward or
               (k.optimizer_in_backward if k else None),
               offload_gradients=choice.offload_gradients or
               (k.offload_gradients if k else None))
    if k is not None and k.checkpoint is not None:
        out["checkpoint"] = k.checkpoint
    if k is not None and k.offload is not None:
        out["offload"] = k.offload
    return out


def describe(choice: Choice, b: int) -> str:
    """"fp16, micro-batch 1 of 32, 18 block(s) offload, fused optimizer"."""
    counts = {m: choice.modes.count(m) for m in set(choice.modes) if m != Mode.KEEP}
    parts = [choice.precision, f"micro-batch {choice.micro_batch_size} of {b}"]
    parts += [f"{n} block(s) {m}" for m, n in sorted(counts.items())]
    if choice.optimizer_state is not None:
        parts.append(f"{choice.optimizer_state} optimizer state")
    if choice.offload_params is not None:
        parts.append(f"block weights on the host ({choice.offload_params})")
    if choice.chunked_loss is not None:
        parts.append(f"loss in {choice.chunked_loss} pieces")
    if choice.optimizer_in_backward:
        parts.append("optimizer in backward")
    if choice.offload_optimizer:
        parts.append("optimizer state" + (" and gradients" if choice.offload_gradients else "")
                     + " on the host")
    elif choice.optimizer_impl is not None:
        parts.append(f"{choice.optimizer_impl} optimizer")
    return ", ".join(parts)
