"""The for-loop optimizer implementation weighed by a bound until a pick may need it (issue 29:
fewer traces per plan).

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

Note 2 (what the bound stands for). Every model the for-loop would have: its plain model and,
where the loss in pieces is weighed, the loss in pieces with the for-loop (the chunked model
with a rise of 0, the chunked trace's own foreach step timed), keyed as the real ones are, so
that a pick names the implementation to trace.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.api._stages import Stages
from memfit.planner.choice import unkey, variant_key
from memfit.planner.variants import chunked_beside

__all__ = ["BOUNDED", "Implementations"]

BOUNDED = ("for-loop",)
_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
            torch.optim.Adagrad)            # the premises tested (Note 1)


class Implementations:
    """The optimizer's other implementations in one plan (``api._planner``): each traced
    at once, or weighed by its bound until it is picked (Note 1). ``models``: the planner's,
    the optimizer as given at ``key``; ``trace(precision, **knobs)``: an estimate of the job;
    ``say``: the plan's stages."""

    def __init__(self, variants: list[str], cls: type | None, models: dict, key: tuple,
                 trace: Callable, say: Stages):
        self.bounded = [i for i in variants if i in BOUNDED and cls in _CLASSES]
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
                    memory.with_optimizer_rise(0.0), time)
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
