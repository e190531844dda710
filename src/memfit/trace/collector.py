"""Python's cycle collector during a trace: what existed before it is frozen.

Note 1 (why). A trace makes Python objects by the hundred thousand (a fake tensor and its
metadata per op, the ledger's events, a composed step's lists), so the collector runs often,
and each third-generation (full) collection walks every object the process holds: torch's and
transformers' modules, the user's model, the traces a plan keeps. In a process holding
XLM-R large and a plan's earlier traces that is about 450,000 objects, and the full
collections took about a tenth of the README plan's CPU time (measured with ``gc.callbacks``:
0.98-1.02 s of 11.8 s; `benchmarks/speed.py --plan`).

Note 2 (what changes, what does not). ``gc.freeze()`` moves every object alive now to a
generation no collection looks at, and sets the young generation's count to 0;
``gc.unfreeze()`` puts the objects back in the oldest. Every object that dies by its reference
count dies at the same moment, so the ledger's frees of those are where they were. The
collections inside the trace look only at what the trace makes, and the young ones are counted
from the trace's start: a storage held only by a cycle (none is in the suite's eager steps,
whose events are unchanged) would die at a young collection placed by the trace's own
allocations, where before it was placed by what the process had allocated until then.
Garbage made before the trace (an earlier stage's cycles) waits until the outermost freeze
ends.

Note 3 (nesting, and a process that froze objects itself). Each call freezes what exists at
its start (a plan's estimate after its earlier stages freezes those stages' objects too); the
outermost one unfreezes at its end. Where objects were frozen before memfit's first call
(a server that freezes after its imports), memfit leaves the collector as it is: ``unfreeze``
would thaw the caller's objects too. ``trace._compile_garbage`` collects instead of freezing
when it finds objects frozen, as it does here.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["old_objects_frozen"]

_ours = False       # a freeze of memfit's is open (Note 3)


@contextlib.contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Inside, the objects alive at entry are out of the collector's reach (Notes 1-3)."""
    global _ours
    if _ours:                          # inside one of ours: what was made since, frozen too
        gc.freeze()
        yield
        return
    if gc.get_freeze_count() > 0:      # someone else's freeze (Note 3)
        yield
        return
    gc.freeze()
    _ours = True
    try:
        yield
    finally:
        _ours = False
        gc.unfreeze()
