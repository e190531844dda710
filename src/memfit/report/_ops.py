"""What each op of a traced step was: its aten op, the module running it, the phase and the
micro-batch. Hover text of the HTML report and frames of the snapshot (``report.snapshot``).

Note 1 (innermost module). The trace keeps, per module, the op spans of each forward call and
each backward (``ModuleRecord.fw_spans`` / ``bw_spans``, timeline op indices). An op belongs to
the innermost module whose span holds it: spans are painted longest first, so a shorter
(nested) span paints over its parents. Ops in no span (zero_grad, a loss outside the model,
the optimizer step) belong to the step itself, ``STEP``.

Note 2 (phase and micro-batch). The root module's forward spans are the micro-batches'
forwards, in order; the root's backward spans their backwards. An op in a forward span is
"forward" of micro-batch k (the k-th span), in a backward span "backward" of the forward before
it; from ``phases["optimizer"]`` on it is the "optimizer" step (micro-batch 0: none); before the
first forward "zero_grad"; between a forward and its backward "loss".
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

__all__ = ["OpInfo", "annotate", "STEP"]

STEP = "(step)"          # ops outside every module (Note 1)


@dataclass
class OpInfo:
    """One entry per op of the timeline."""

    op: list[str]            # aten op, without the "aten." prefix
    module: list[str]        # innermost running module's qualified name, or STEP (Note 1)
    module_type: dict[str, str]   # qualified name -> class name
    phase: list[str]         # zero_grad | forward | loss | backward | optimizer (Note 2)
    micro_batch: list[int]   # 1-based; 0 in the optimizer step and before the first forward

    def parents(self, name: str) -> list[str]:
        """``name`` and its ancestors among the traced modules, innermost first."""
        if name == STEP:
            return []
        out, parts = [], name.split(".")
        for k in range(len(parts), 0, -1):
            n = ".".join(parts[:k])
            if n in self.module_type:
                out.append(n)
        if name != "" and "" in self.module_type:
            out.append("")
        return out or [name]


def annotate(est) -> OpInfo:
    """``OpInfo`` of an ``Estimate``'s timeline (module Notes)."""
    n = len(est.timeline)
    ops = [o.removeprefix("aten.") for o in (est.op_log or [])] + [""] * (n - len(est.op_log or []))
    names = list(est.modules)
    owner = np.full(n, -1, dtype=np.int64)
    spans = [(e - s, s, e, i) for i, name in enumerate(names)
             for s, e in _spans(est.modules[name])]
    for _, s, e, i in sorted(spans, reverse=True):       # longest first (Note 1)
        owner[max(s, 0):min(e, n - 1) + 1] = i
    module = [names[i] if i >= 0 else STEP for i in owner.tolist()]
    phase, micro = _phases(est, n)
    return OpInfo(ops, module, {k: r.type for k, r in est.modules.items()}, phase, micro)


def _spans(record) -> list[tuple[int, int]]:
    out = list(record.fw_spans) + list(record.bw_spans)
    if not out:
        out = [s for s in (record.fw_span, record.bw_span) if s is not None]
    return out


def _phases(est, n: int) -> tuple[list[str], list[int]]:
    root = est.modules.get("")
    fw = sorted(root.fw_spans) if root is not None and root.fw_spans else []
    bw = sorted(root.bw_spans) if root is not None and root.bw_spans else []
    opt = est.phases.get("optimizer", n)
    if not fw:                           # no root spans (a user's step): the phase starts only
        starts = sorted((i, name) for name, i in est.phases.items())
        phase = []
        for i in range(n):
            j = bisect.bisect_right([s for s, _ in starts], i) - 1
            phase.append(starts[j][1] if j >= 0 else "zero_grad")
        return phase, [0 if p == "optimizer" else 1 for p in phase]
    fw_starts = [s for s, _ in fw]
    phase, micro = [], []
    for i in range(n):
        k = bisect.bisect_right(fw_starts, i)            # forwards begun so far
        if i >= opt:
            phase.append("optimizer")
            micro.append(0)
        elif k == 0:
            phase.append("zero_grad")
            micro.append(0)
        elif i <= fw[k - 1][1]:
            phase.append("forward")
            micro.append(k)
        elif any(s <= i for s, _ in bw if s > fw[k - 1][1]):
            phase.append("backward")
            micro.append(k)
        else:
            phase.append("loss")
            micro.append(k)
    return phase, micro
