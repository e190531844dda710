"""The optimizer's other implementations (for-loop, fused) and low-bit states (bf16, 4-bit)
weighed by bounds until a pick may need one (issue 29: fewer traces per plan).

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
foreach model with the fused trace's rise and optimizer time (docs/planner.md). Whatever its
kernels, a step reads every trainable parameter, its gradient and the state, so the fused
trace's ops touch at least the gradients' bytes twice (a parameter has its gradient's size and
dtype) and the state's once: the bound is the foreach model with a rise of 0 and an optimizer
step of one op touching that (``TimeModel.with_optimizer_touching``), no slower than the fused
model at any placement of the state (on the host the step's touched bytes are its pass
there). tests/api/test_plan_deferred.py holds the premise on each class below at fp16, bf16 and
bf16-pure. It is tight enough to be passed over where a low-bit state wins (the README's plan:
0.3 s of trace saved, and a plan whose plain step fits no longer traces the fused step at
all); where the fused state fits on the device, the bound is picked and the fused step
traced, as before.

Note 4 (the bf16 and 4-bit states' bounds). Where the numerics may change, each low-bit state
is a model beside each plain one (planner.variants): its state's bytes and its step, from a
trace of the optimizer phase with it (0.55 s for bf16 and 1.2 s for 4-bit in the README's
plan, where 8-bit, 0.35 s, wins). torchao's bf16 and 4-bit states are stepped by memfit's own
unrolled step (techniques/_torchao_optimizer.py), which loads each moment into an fp32 tensor
and stores it back from one; a parameter too small for torchao's blocks keeps fp32 moments,
read and written whole. So the state holds at least both moments' codes (2 bytes an element
each in bf16, half a byte in 4-bit), the step rises at least 0, and its ops touch at least the
parameter twice and the gradient once (its size: three times the gradients' bytes), both
moments' codes twice, and an fp32 copy of each moment written and read (16 bytes an element):
``state_bound``, the state's model with that state and that step, fits wherever the traced
model would and is no slower. Traced, the steps touch 168 (bf16) and 1,040 (4-bit) bytes an
element of XLM-R large against the bounds' 36 and 30, and 8-bit's own step touches 22: a bound
loses to a traced 8-bit state wherever the bound's memory does not buy a faster plan, and
the README's plan traces neither (1.7 s). 8-bit, stepped by bitsandbytes' fused kernel, is
traced at once. tests/api/test_plan_deferred.py holds the premises on Adam and AdamW at fp16
and bf16 on two models, and the plans to the plans with every state traced up front.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from memfit.api._stages import Stages
from memfit.planner.choice import unkey, variant_key
from memfit.planner.variants import LOW_BIT_STATES, add_low_bit, chunked_beside, low_bit_keys

__all__ = ["BOUNDED", "BOUNDED_STATES", "traced_states", "Implementations", "LowBitStates",
           "search_with_bounds", "state_bound"]

BOUNDED = ("for-loop", "fused")
_CLASSES = {                                # the premises tested (Notes 1 and 3)
    "for-loop": (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.RMSprop,
                 torch.optim.Adagrad),
    "fused": (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad),
}
BOUNDED_STATES = ("bf16", "4bit")           # torchao's, stepped by memfit's own unrolled step
_STATE_CLASSES = (torch.optim.Adam, torch.optim.AdamW)      # the premises tested (Note 4)
_STATE_BITS = {"bf16": 16, "4bit": 4}       # a moment's code per element


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

    def with_bounds(self, models: dict) -> dict:
        """``models`` and the bound of each implementation not traced yet: of its plain model
        and of the loss in pieces with it (Note 2)."""
        out = dict(models)
        for key, (memory, time) in models.items():
            parts = unkey(key)
            if key[0] != self.key[0] or parts[1] != self.key[1] or any(parts[2:4]) or \
                    any(parts[5:]):          # a state, offload, in backward, grads on the host
                continue
            for impl in self.bounded:
                out[variant_key(key[0], impl, None, None, parts[4])] = (
                    memory.with_optimizer_rise(0.0), _time_bound(impl, memory, time))
        return out

    def traced_pick(self, choice) -> bool:
        """Where ``choice`` is a bound of this plan's, trace its implementation (Note 1)."""
        impl = unkey(choice.key)[1]
        if choice.key[0] != self.key[0] or impl not in self.bounded:
            return False
        self._say.expect(3)             # its trace, the search and the verify
        self.trace(impl)
        return True


class LowBitStates:
    """The low-bit optimizer states of one plan (``api._plan_levers``): 8-bit traced at once,
    bf16 and 4-bit weighed by bounds until a pick needs one (Note 4). ``models``/``traces``:
    the planner's (precision -> its plain trace); ``trace``: the levers' trace;
    ``numel``: the trainable parameters' elements."""

    def __init__(self, models: dict, traces: dict, trace: Callable, say: Stages, numel: int):
        self.models, self._traces, self._trace, self._say = models, traces, trace, say
        self.numel = numel
        self.bounded: list[str] = []
        self.keys: list[tuple] = []

    def add(self, cls: type | None) -> None:
        """Trace each state no bound stands for (planner.variants), and weigh the others by
        their bounds where the premises hold: torch's Adam or AdamW (``cls``), torchao
        installed. The plain models they stand beside are those of now: a state traced later
        is modelled beside the same ones, as if traced now."""
        self.keys = low_bit_keys(self.models)
        add_low_bit(self.models, self._traces, self._trace, self._say, states=traced_states(),
                    keys=self.keys)
        if self.keys and cls in _STATE_CLASSES and importlib.util.find_spec("torchao"):
            self.bounded = [s for s in LOW_BIT_STATES if s in BOUNDED_STATES]

    def trace(self, state: str) -> None:
        """The models of ``state`` (planner.variants), and of the loss in pieces with it where
        that is modelled."""
        self.bounded.remove(state)
        if add_low_bit(self.models, self._traces, self._trace, self._say, states=(state,),
                       keys=self.keys):
            for key in self.keys:
                chunked_beside(self.models, key, variant_key(key[0], None, state))

    def trace_bounded(self) -> None:
        """Every state still weighed by its bound (the floor weighs real models)."""
        for state in list(self.bounded):
            self.trace(state)

    def with_bounds(self, models: dict) -> dict:
        """``models`` and the bound of each state not traced yet, beside each plain model
        ``add_low_bit`` takes, and beside the loss in pieces where that is modelled (Note 4)."""
        out = dict(models)
        for state in self.bounded:
            for key in self.keys:
                memory, time = models[key]
                bound = variant_key(key[0], None, state)
                out[bound] = state_bound(memory, time, state, self.numel)
                chunked_beside(out, key, bound)
        return out

    def traced_pick(self, choice) -> bool:
        """Where ``choice`` is a bound of this plan's, trace its state (Note 4)."""
        state = unkey(choice.key)[2]
        if state not in self.bounded:
            return False
        self._say.expect(3)             # its trace, the search and the verify
        self.trace(state)
        return True


def traced_states() -> tuple[str, ...]:
    """The low-bit states traced at once (8-bit), no bound standing for them (Note 4)."""
    return tuple(s for s in LOW_BIT_STATES if s not in BOUNDED_STATES)


def search_with_bounds(search: Callable[[dict], object], models: dict, deferred: list):
    """``search(models)`` over the planner's models and the bounds of each of ``deferred``
    (``Implementations``, ``LowBitStates``); where it picks a bound, that variant is traced
    and the search runs again (Note 1)."""
    while True:
        weighed = models
        for d in deferred:
            weighed = d.with_bounds(weighed)
        choice = search(weighed)
        if choice is None or not any(d.traced_pick(choice) for d in deferred):
            return choice


def state_bound(memory, time, state: str, numel: int):
    """The (memory, time) bound of a model with the low-bit ``state`` beside the plain model
    ``(memory, time)`` (Note 4): both moments' codes as its state, a rise of 0, a step touching
    the parameters twice and the gradients once, both moments' codes twice and an fp32 copy
    of each written and read."""
    state_bytes = 2 * numel * _STATE_BITS[state] // 8
    touched = 3 * memory.grads_bytes + 2 * state_bytes + 16 * numel
    return memory.with_state_bytes(state_bytes, 0.0), time.with_optimizer_touching(touched)


def _time_bound(impl: str, memory, time):
    """The time model of ``impl``'s bound: foreach's for the for-loop (Note 1), the least
    step touching the gradients twice and the state once for the fused step (Note 3)."""
    if impl == "for-loop":
        return time
    return time.with_optimizer_touching(2 * memory.grads_bytes + memory.optimizer_state_bytes)
