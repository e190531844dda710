"""The user's precision held back until a pick of the search may be slower than it (issue 29:
fewer traces per plan).

Note 1 (the bound). Precision "auto" weighs the user's own precision beside the 16-bit one it
searches first (``api._planner``'s other precisions): fp32 on a card whose fp16 the time model prices no
faster, with its half-batch trace and the optimizer stepped in backward, two traces more. Yet
every configuration at a precision takes at least that precision's forward and backward of the
whole batch in one micro-batch (``TimeModel.forward_backward_s(1, b)``): more micro-batches
repeat each op's fixed cost, recompute and offload add time, and the optimizer step, which the
other levers change, is left out of the bound. So a pick of the search without that precision
that is predicted no slower than its bound is the pick the search would make with it, and the
verify loop takes the same path (its margins are per precision). Only where a pick is slower
than the bound, or nothing fits without it, is the precision traced, before that pick is
verified, and the search run again with it (``api._planner``'s ``propose``). Only the user's
precision is held back: its plain trace, which the bound reads, is traced anyway (the
step-time ratio's base). The floor weighs every precision. On the README's job (fp16 picked at
0.89x of the plain fp32 step, whose forward and backward alone are 0.99x) this saves fp32's
half-batch trace and its optimizer-in-backward trace.
"""

from __future__ import annotations

__all__ = ["held_back", "may_beat"]


def held_back(user: str, others: list[str]) -> list[str]:
    """The precisions left untraced until a pick may be slower (Note 1): the user's own, where
    it is among those weighed beside the searched one."""
    return [user] if user in others else []


def may_beat(user_pair, b: int, pick_s: float | None) -> bool:
    """Whether a configuration at the held-back precision could be faster than a pick of
    ``pick_s`` seconds (None: nothing fits): its forward and backward bound is below it
    (Note 1)."""
    if pick_s is None:
        return True
    return user_pair[1].forward_backward_s(1, b) < pick_s
