"""What a compile leaves alive: Dynamo's garbage, kept through the step as a real run keeps it
(trace.compiled; docs/compiled.md, "Measured").

Note 1 (the garbage). While Dynamo compiles a frame it wraps what the frame reads in its own
objects (``VariableTracker``s, the lazy caches holding a value until it is read), which refer to
each other in cycles. When the compile ends they are garbage that only Python's cycle collector
frees, and they still hold the real objects of the call that was compiled: a transformers
``DynamicCache`` among them, with every layer's keys and values of that step. A compile makes
so many objects that its own collections move them to the oldest generation, which Python
collects only when it has grown by a quarter, so in a real run they outlive the next steps.
Measured on per-block compiled tiny llama (use_cache on): at step 2's start, step 0's cache
(4 x 8,192 B) was alive, held by ``UserDefinedObjectVariable(DynamicCache)`` and a
``LazyCache``; a ``gc.collect()`` before step 2 freed it (-33,024 B at the peak); whole-model
compiled gpt2 keeps its step-0 cache the same way (98 KB, 4%). When a full collection comes
first (a warm Inductor cache makes fewer objects), the run peaks lower: the figure is the
run's peak until then.

Note 2 (how the trace keeps it). A compiled trace runs two steps (Dynamo compiles in the first)
with the collector off until the second starts, so no collection the trace's own objects
trigger reaches the compile's garbage earlier than the real run's would. Between the steps,
``keep`` collects with ``DEBUG_SAVEALL`` (the garbage saved, not freed), keeps what Dynamo's
garbage reaches and frees the rest at once, as a real run's young collections free a step's
other cycles. So the counted step holds the first step's cache from its start to its end, as
step 2 of a real run does; the kept storages are counted where they were born (the first step),
so the ledger needs nothing new. The collector is on again for the counted step. What exists
before the trace (an earlier trace's garbage among it) is frozen (``gc.freeze``) until then:
``keep`` neither keeps it nor spends time on it, looking at the trace's own objects alone (a
full collection of a process holding torch and transformers takes about 0.2 s). Where something
else froze objects already, a collection before the trace frees what is garbage instead.
"""

from __future__ import annotations

import gc

import torch

from memfit.measure._ledger import storages_of

__all__ = ["CompileGarbage"]


class CompileGarbage:
    """Inside: the collector off until ``keep``, then on; ``kept_bytes`` is what ``keep`` kept
    alive (Note 2). Leaving lets the kept objects go."""

    def __init__(self):
        self.kept: list = []
        self.kept_bytes = 0
        self._was_enabled = False
        self._froze = False
        self._off = False

    def __enter__(self) -> "CompileGarbage":
        self._was_enabled = gc.isenabled()
        # what exists now (an earlier trace's garbage among it) is not this trace's: frozen,
        # no collection of ours looks at it, and each looks at this trace's objects alone
        self._froze = gc.get_freeze_count() == 0       # else someone else's freeze: collect
        if self._froze:
            gc.freeze()
        else:
            gc.collect()
        gc.disable()
        self._off = True
        return self

    def keep(self) -> None:
        """Collect; keep what Dynamo's garbage reaches, free the rest; collector back on."""
        flags, before = gc.get_debug(), len(gc.garbage)
        gc.set_debug(flags | gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            garbage = gc.garbage[before:]
            del gc.garbage[before:]
        finally:
            gc.set_debug(flags)
        by_id = {id(o): o for o in garbage}
        stack = [o for o in garbage if type(o).__module__.startswith("torch._dynamo")]
        reached: set[int] = set()
        while stack:
            o = stack.pop()
            if id(o) in reached:
                continue
            reached.add(id(o))
            stack += [r for r in gc.get_referents(o) if id(r) in by_id]
        self.kept = [by_id[i] for i in reached]
        storages = {st._cdata: st.nbytes() for o in self.kept      # issubclass: not a proxy
                    if issubclass(type(o), torch.Tensor) and o.device.type != "meta"
                    for st in storages_of(o)}
        self.kept_bytes = sum(storages.values())
        del garbage, by_id, stack
        gc.collect()             # the rest, unreachable again: freed before the counted step
        self._restore()

    def _restore(self) -> None:
        if self._off:
            self._off = False
            if self._froze:
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()

    def __exit__(self, *exc) -> None:
        self._restore()
        self.kept = []
