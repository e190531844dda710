"""The optimizer's other implementations (for-loop, fused) weighed by bounds until a pick may
need one (issue 29: fewer traces per plan).

Note 1 (why the for-loop is traced only when it may win). On a GPU target the planner weighs
the other implementations of the optimizer (``api._planner``): fused and for-loop, each
a trace of the optimizer phase (0.6 s of the README's plan for the for-loop). The for-loop
steps one parameter at a time: the same ops as the default foreach step, per tensor instead of
per list. So it keeps the same state, made by the same ``_init_group``; its step's rise above
the level it starts from is at least 0; and the time model prices it slower than foreach, a
launch per parameter instead of per list over the same bytes (3.3x to 18x foreach's step on
gpt2 with each class below, 1.45x to 2.0x on four zoo models; tests/api/test_plan_deferred.py
holds the premises). The bound of a for-loop model is therefore the foreach model with a rise
of 0: it fits wherever the for-loop would and is predicted no slower. The search weighs the
bound; where it picks the bound, the for-loop is traced and the search runs again with it, so
a pick that is not a bound is the pick the search makes with the for-loop traced (the bound
ties the foreach model at best, and a tie goes to the model searched first, the foreach one;
the real for-loop is strictly slower). The floor weighs real models only: it traces the
for-loop first. Only torch's own classes, whose premises are tested, are bounded; any other
class that takes ``foreach`` traces its for-loop as before.

Note 2 (what the bound stands for). Every model the implementation would have: its plain
model and, where the loss in pieces is weighed, the loss in pieces with it (the chunked model
with a rise of 0, its step timed as the plain bound's is), keyed as the real ones are, so that
a pick names the implementation to trace.

Note 3 (the fused step's bound). A fused step is timed faster than foreach (one kernel per
group, no parameter-sized temporaries), so foreach's time bounds nothing; its model is the
foreach model with the fused trace's rise and optimizer time (docs/planner.md). Whatever its kernels, a step reads every trainable parameter,
its gradient and the state, so the fused trace's ops touch at least the gradients' bytes twice
(a parameter has its gradient's size and dtype) and the state's once: the bound is the foreach
model with a rise of 0 and an optimizer step of one op touching that (``TimeModel.
with_optimizer_touching``), no slower than the fused model at any placement of the state (on
the host the step's touched bytes are its pass there). tests/api/test_plan_deferred.py holds
the premise on each class below at fp16 and bf16. It is tight enough to be passed over where a
low-bit state wins (the README's plan: 0.3 s of trace saved, and a plan whose plain step fits
no longer traces the fused step at all); where the fused state fits on the device, the bound
is picked and the fused step traced, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.api._stages import Stages
from memfit.planner.choice import unkey, variant_key
from memfit.planner.variants import chunked_beside

__all__ = ["BOUNDED", "Implementations"]

BOUNDED = ("for-loop", "fused")
_CLASSES = {                                # the premises tested (Notes 1 and 3)
    "for-loop": (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
                 torch.optim.Adagrad),
    "fused": (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad),
}


class Implementations:
    """The optimizer's other implementations in one plan (``api._planner``): each traced
    at once, or weighed by its bound until it is picked (Note 1). ``models``: the planner's,
    the optimizer as given at ``key``; ``trace(precision, **knobs)``: an estimate of the job;
    ``say``: the plan's stages."""

    def __init__(self, variants: list[str], cls: type | None, models: dict, key: tuple,
                 trace: Callable, say: Stages):
        self.bounded = [i for i in variants if i in BOUNDED and cls in _CLASSES[i]]
        self.now = [i for i in variants if i not in self.bounded]
        self.models, self.key, self._trace, self._say = models, key, trace, say

    def trace(self, impl: str) -> None:
        """The model of ``impl`` (its optimizer step alone, without the allocator's replay:
        the models read no replay), and of the loss in pieces with it where that is modelled
        (planner.variants)."""
        if impl in self.bounded:
            self.bounded.remove(impl)
        p = self.key[0]
        self._say(f"tracing the optimizer step with the {impl} implementation")
        other = self._trace(p, optimizer_impl=impl, optimizer_only=True, allocator_replay=False)
        memory, time = self.models[self.key]
        self.models[(p, impl)] = (memory.with_optimizer_step(other),
                                  time.with_optimizer_step(other))
        chunked_beside(self.models, self.key, (p, impl))

    def trace_bounded(self) -> None:
        """Every implementation still weighed by its bound (the floor weighs real models)."""
        for impl in list(self.bounded):
            self.trace(impl)

    def with_bounds(self) -> dict:
        """The planner's models and the bound of each implementation not traced yet: of its
        plain model and of the loss in pieces with it (Note 2)."""
        out = dict(self.models)
        for key, (memory, time) in self.models.items():
            parts = unkey(key)
            if key[0] != self.key[0] or parts[1] != self.key[1] or any(parts[2:4]) or \
                    any(parts[5:]):          # a state, offload, in backward, grads on the host
                continue
            for impl in self.bounded:
                out[variant_key(key[0], impl, None, None, parts[4])] = (
                    memory.with_optimizer_rise(0.0), _time_bound(impl, memory, time))
        return out

    def searched(self, search: Callable[[dict], object]):
        """``search(models)`` over the planner's models and the bounds; where it picks a
        bound, that implementation is traced and the search runs again (Note 1)."""
        while True:
            choice = search(self.with_bounds())
            impl = unkey(choice.key)[1] if choice is not None else None
            if choice is None or choice.key[0] != self.key[0] or impl not in self.bounded:
                return choice
            self._say.expect(3)             # its trace, the search and the verify
            self.trace(impl)


def _time_bound(impl: str, memory, time):
    """The time model of ``impl``'s bound: foreach's for the for-loop (Note 1), the least
    step touching the gradients twice and the state once for the fused step (Note 3)."""
    if impl == "for-loop":
        return time
    return time.with_optimizer_touching(2 * memory.grads_bytes + memory.optimizer_state_bytes)
