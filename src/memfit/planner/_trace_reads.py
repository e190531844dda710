"""What the planner's models read off a traced step: where the optimizer step starts and how
far it rises, and a block's forward and backward passes, paired."""

from __future__ import annotations

__all__ = ["optimizer_rise_bytes", "level_before", "block_passes"]


def optimizer_rise_bytes(est) -> int:
    """What the optimizer step of ``est`` allocates above the level it starts from (>= 0)."""
    start = est.phases.get("optimizer")
    if start is None or not 0 <= start < len(est.timeline):
        return 0
    return max(max(est.timeline[start:]) - level_before(est, start), 0)


def level_before(est, op: int, category: str | None = None) -> int:
    """Live bytes (of ``category``, else all) just before op ``op`` of ``est``'s timeline."""
    if op > 0:
        return (est.timeline_by_category[category] if category else est.timeline)[op - 1]
    start = est.start_breakdown
    return start.get(category, 0) if category else sum(start.values())


def block_passes(r) -> list[tuple[tuple, tuple, int]] | None:
    """A block's passes, ``(forward span, backward span, saved bytes)`` each, or None where the
    trace cannot pair them (``planner.memory_model``'s passes)."""
    if r is None:
        return None
    calls = r.call_saved_bytes
    fws = [(span, saved) for span, saved in zip(r.fw_spans, calls) if saved > 0] \
        if len(calls) == len(r.fw_spans) else []
    if not fws or len(r.bw_spans) != len(fws) or any(e < s for s, e in r.bw_spans):
        return None        # an empty backward: one layer applied in turn (ALBERT's), unpaired
    out, free = [], list(fws)
    for bw in r.bw_spans:
        before = [f for f in free if f[0][1] < bw[0]]
        if not before:
            return None
        fw, saved = before[-1]
        free.remove(before[-1])
        if fw[0] < 1:
            return None
        out.append((fw, bw, saved))
    return sorted(out)
