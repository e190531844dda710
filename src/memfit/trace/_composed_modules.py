"""The module records of a step composed by ``trace.block_reuse``.

A composed block's modules take the records of the twin block they copy; a module outside the
blocks takes twin A's totals plus the slope A - B per block more. FLOPs, bytes touched and op
counts are summed again over the composed ops that ran while each module did (``op_totals``),
as ``ModuleWatch`` adds them up op by op; spans and peaks come from the composed windows
(``Tracker._finish_modules``).
"""

from __future__ import annotations

from dataclasses import replace

from memfit.measure import Tracker
from memfit.measure._labels import GLOBAL
from memfit.measure._modules import ModuleRecord
from memfit.trace._block_twin import MID
from memfit.trace._step_log import NotComposable, StepLog

__all__ = ["module_records", "op_totals"]


_TOTALS = ("calls", "param_bytes", "input_bytes", "saved_bytes")


def op_totals(t: Tracker, op_windows) -> None:
    """Each module's FLOPs, bytes touched and ops, summed over the ops that ran while it did,
    forward or backward by the op (as ``ModuleWatch`` adds them up op by op): a module's
    backward may stay open while the blocks below it run theirs, so these are not its block's
    alone."""
    flops, touched = [0], [0]
    for cost in t.op_costs:
        flops.append(flops[-1] + cost[0])
        touched.append(touched[-1] + cost[1])
    for rec in t.watch.records.values():
        rec.fw_flops = rec.bw_flops = rec.fw_touched_bytes = rec.bw_touched_bytes = 0
        rec.fw_ops = rec.bw_ops = 0
    back = [0]
    for b in t.op_backward:
        back.append(back[-1] + b)
    for name, _, first, end in op_windows:
        rec = t.watch.records.get(name)
        first = max(first, t._window_op)
        if rec is None or end <= first:
            continue
        bw_ops = back[end] - back[first]
        if bw_ops == 0:
            rec.fw_flops += flops[end] - flops[first]
            rec.fw_touched_bytes += touched[end] - touched[first]
            rec.fw_ops += end - first
        elif bw_ops == end - first:
            rec.bw_flops += flops[end] - flops[first]
            rec.bw_touched_bytes += touched[end] - touched[first]
            rec.bw_ops += end - first
        else:                  # a window open across forward and backward: op by op
            for j in range(first, end):
                f, b = t.op_costs[j][0], t.op_costs[j][1]
                if t.op_backward[j]:
                    rec.bw_flops, rec.bw_touched_bytes, rec.bw_ops = \
                        rec.bw_flops + f, rec.bw_touched_bytes + b, rec.bw_ops + 1
                else:
                    rec.fw_flops, rec.fw_touched_bytes, rec.fw_ops = \
                        rec.fw_flops + f, rec.fw_touched_bytes + b, rec.fw_ops + 1


def module_records(a: StepLog, b: StepLog, n: int, marks, cs) -> dict[str, ModuleRecord]:
    """Each module's record for ``n`` blocks: a block's from its twin block, a global
    module's totals affine in the blocks, A - B their slope; spans and peaks are left to the
    tracker. ``cs(slot, copy)``: the composed block of twin A's ``slot`` (its ``copy``)."""
    extra = n - a.depth
    ra, rb = a.tracker.watch.records, b.tracker.watch.records
    order: dict[str, int] = {}
    for mk, name, phase, _, _ in marks:
        if mk == "enter" and phase == "fw" and name not in order:
            order[name] = len(order)
    out: dict[str, ModuleRecord] = {}

    def fresh(rec: ModuleRecord, name: str, **totals) -> ModuleRecord:
        return replace(rec, name=name, order=order.get(name, -1), fw_span=None, bw_span=None,
                       fw_spans=[], bw_spans=[], fw_peak_bytes=0, bw_peak_bytes=0,
                       call_saved_bytes=list(totals.pop("call_saved_bytes",
                                                        rec.call_saved_bytes)),
                       _saved=set(), _call_saved=set(), **totals)

    for name, rec in ra.items():
        slot = a.slot_of_module(name)
        if slot == GLOBAL:
            other = rb.get(name)
            if other is None:
                raise NotComposable(f"module {name!r} is in twin A only")
            totals = {f: getattr(rec, f) + extra * (getattr(rec, f) - getattr(other, f))
                      for f in _TOTALS}
            if len(rec.call_saved_bytes) != len(other.call_saved_bytes):
                raise NotComposable(f"module {name!r} runs a different number of times")
            totals["call_saved_bytes"] = [x + extra * (x - y) for x, y in
                                          zip(rec.call_saved_bytes, other.call_saved_bytes)]
            out[name] = fresh(rec, name, **totals)
            continue
        rest = name[len(a.prefix) + 1:].partition(".")[2]
        copies = range(n - a.depth + 1) if slot == MID else [None]
        for c in copies:
            new = f"{a.prefix}.{cs(slot, c)}" + (f".{rest}" if rest else "")
            out[new] = fresh(rec, new)
    return dict(sorted(out.items(), key=lambda kv: (kv[1].order < 0, kv[1].order)))
