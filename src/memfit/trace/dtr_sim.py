"""Simulate DTR (``memfit.remat``) on a traced step: predicted peak, recompute FLOPs, floor.

Note 1 (what is replayed). The plain step's live-bytes timeline (one point per aten op, from
``profile_step``) and, per block, its forward and backward op spans, the bytes autograd saved
inside it, the bytes of its inputs and its forward FLOPs (the ``ModuleRecord`` of the trace).
Walking the ops in order, the live bytes under DTR are the plain ones minus what is evicted
now. When they would pass the budget, blocks are evicted, cheapest first by the runtime's
heuristic: forward FLOPs / (evictable bytes x staleness in ops since the forward ended). A
candidate is a block whose forward has ended and whose backward has not begun; the first op of
its backward brings its bytes back and costs its forward FLOPs again (the recompute).

Note 2 (what it leaves out). A block's evictable bytes are what it saved minus its inputs, which the
runtime keeps to recompute from (a checkpoint's view). The runtime also drops an input whose
producer is evicted too (recomputing it then reruns the producer) and so reaches lower at tight
budgets, at the price of chained recomputes; the simulation models neither that chain nor the
transient bytes of a recompute, nor saves outside blocks (never evicted). Where evictions do not
chain (moderate budgets) it predicts the runtime's evictions and recompute FLOPs exactly (a test
holds it to that); at the tightest budgets it is an estimate, each way.

Note 3 (the floor). Eviction only removes bytes until the block's backward, so a budget is
reachable exactly when, at every op, the plain live bytes minus every candidate's evictable
bytes fit: ``floor_bytes`` is the largest such remainder over the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockSpan", "DtrSimulation", "simulate_dtr", "spans_from_modules"]


@dataclass(frozen=True)
class BlockSpan:
    """One block of the traced step (Note 1). Spans are inclusive op indices of the timeline."""

    name: str
    fw_span: tuple[int, int]
    bw_span: tuple[int, int]
    evictable_bytes: int     # saved minus inputs (Note 2)
    fw_flops: int            # the cost of one recompute


@dataclass
class DtrSimulation:
    """DTR replayed under ``budget_bytes`` on one traced step."""

    budget_bytes: int
    peak_bytes: int                  # predicted live-bytes peak under DTR
    plain_peak_bytes: int            # the traced step's own peak
    floor_bytes: int                 # the least budget the simulation can reach (Note 3)
    recompute_flops: int             # forward FLOPs rerun by recomputes
    evictions: int
    feasible: bool                   # budget_bytes >= floor_bytes
    evicted: list[str] = field(default_factory=list)   # block names, in eviction order


def spans_from_modules(modules: dict, blocks: list[str]) -> list[BlockSpan]:
    """``BlockSpan``s from a trace's ``ModuleRecord``s (blocks without both spans are left out)."""
    out = []
    for name in blocks:
        r = modules[name]
        if r.fw_span is None or r.bw_span is None or r.bw_span[0] <= r.fw_span[1]:
            continue
        out.append(BlockSpan(name, tuple(r.fw_span), tuple(r.bw_span),
                             max(0, r.saved_bytes - r.input_bytes), r.fw_flops))
    return out


def _candidates(blocks: list[BlockSpan], t: int) -> list[int]:
    return [i for i, b in enumerate(blocks) if b.fw_span[1] < t < b.bw_span[0]]


def floor_bytes(timeline: list[int], blocks: list[BlockSpan]) -> int:
    """Note 3: max over ops of the plain live bytes minus every candidate's evictable bytes."""
    return max((live - sum(blocks[i].evictable_bytes for i in _candidates(blocks, t))
                for t, live in enumerate(timeline)), default=0)


def simulate_dtr(timeline: list[int], blocks: list[BlockSpan], budget_bytes: int,
                 min_evict_bytes: int = 4096) -> DtrSimulation:
    """Replay the timeline under ``budget_bytes`` with the runtime's heuristic (Note 1)."""
    starts = {b.bw_span[0]: i for i, b in enumerate(blocks)}
    evicted: dict[int, int] = {}           # block index -> bytes evicted
    order: list[str] = []
    reduction = peak = flops = 0
    for t, live in enumerate(timeline):
        i = starts.get(t)
        if i is not None and i in evicted:          # its backward begins: recompute it
            reduction -= evicted.pop(i)
            flops += blocks[i].fw_flops
        now = live - reduction
        while now > budget_bytes:
            best, best_h = None, None
            for j in _candidates(blocks, t):
                b = blocks[j]
                if j in evicted or b.evictable_bytes < max(1, min_evict_bytes):
                    continue
                h = (b.fw_flops + 1) / (b.evictable_bytes * max(t - b.fw_span[1], 1))
                if best_h is None or h < best_h:
                    best, best_h = j, h
            if best is None:
                break
            evicted[best] = blocks[best].evictable_bytes
            order.append(blocks[best].name)
            reduction += evicted[best]
            now -= evicted[best]
        peak = max(peak, now)
    floor = floor_bytes(timeline, blocks)
    return DtrSimulation(budget_bytes=budget_bytes, peak_bytes=peak,
                         plain_peak_bytes=max(timeline, default=0), floor_bytes=floor,
                         recompute_flops=flops, evictions=len(order),
                         feasible=budget_bytes >= floor, evicted=order)
