"""A GPU trace's first step, made from the counted step instead of traced.

Note 1 (why, and what differs). The caching allocator's replay (``trace.cuda``) needs what came
before the counted step: the blocks the first step split, cached and left free. Tracing that
step costs as much as the counted one (half of a plan's traces: the plain steps and the
verify). The first step of a step whose optimizer makes its state as torch's Adam does differs
from the steady one in three things, and in nothing else (``tests/trace/test_first_step.py``):

- no gradient is alive at its start, so its ``zero_grad`` frees none; it makes each gradient
  where the counted step makes the gradient of the same parameter, and that gradient is the
  one alive at the counted step's start (the one its ``zero_grad`` frees);
- its optimizer makes the state: torch's Adam and AdamW in ``_init_group``, group by group
  before the group's update, each parameter with a gradient in order, its tensors in the order
  of its state dict (the order the warm-up made them in, which the tracker registered);
- a GradScaler makes its scale and growth tracker at its first ``scale()``.

So the first step is the counted step's events with those changes, placed at marks recorded
while the counted step ran (``Recorder``: ``("first", tag)`` marks where ``_init_group`` and
the first ``scale()`` were called), each storage it makes afresh given an id of its own
(``Ledger.add_unseen``). ``make`` puts the events on the ledger (``measure._first_step_log``),
which gives them before its own in ``device_events``, every index after them shifted; every
figure of the counted step is the traced one, and every replay reads the first step as if it
had been traced. A composed step carries the marks and the pairs through
``block_reuse.compose`` (docs/block-reuse.md).

Note 2 (when the first step is traced instead). Only torch's Adam or AdamW making its state
in ``_init_group`` (``trace.profile.makes_state_in_init_group``) and bitsandbytes' 8-bit step on
its fused kernel (Note 3) are known well enough, alone or inside a wrapper whose own step is
the same every step (Note 4). And the counted step must be a steady one: it frees nothing
alive before it but gradients (parameter offload releases the weights it fetched), leaves
nothing alive it made but gradients (a cache a model fills on its first call would be one), and
reaches each mark once. Otherwise ``make`` raises ``NotMade`` and the step is traced twice, as
it is for any other optimizer, a user's step, a compiled model, a rank of several GPUs and a
shared symbolic trace (``api._traced``). ``traced_first_steps()`` traces every first step
(the oracle of the tests, and the benchmarks' side-by-side).

Note 3 (bitsandbytes). Its ``step`` makes each parameter's state (``init_state``) right before
that parameter's ``update_step``, so the mark is per parameter, tagged with the parameter's
name (a block's parameter is copied per block when composed, as its ops are). Its quantization
maps (``name2qmap``) are made with the optimizer, before any step, and shared by every
parameter's state: they are not the first step's.

Note 4 (a wrapper). bf16-pure's ``MasterWeightsOptimizer`` makes fp32 gradients for its master
weights, steps its inner optimizer and frees them, the same in every step; optimizer offload's
``OffloadedOptimizer`` moves the gradients to the host and the weights back around its inner
optimizer's step, the same in every step. The first step differs only where the inner optimizer
makes the state. A wrapper says so by ``steady_inner()``; the marks and tags are then the inner
optimizer's, its parameters (master weights, host twins) were made before any step
(``first.older``), and a host gradient alive before the step is paired as a device one is.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections import Counter
from contextvars import ContextVar

import torch
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._pytree import tree_flatten

from memfit.measure._ledger import GRADS, OPTIMIZER, TEMPORARIES
from memfit.trace.profile import makes_state_in_init_group

__all__ = ["NotMade", "Recorder", "may_make", "make", "traced_first_steps"]

_TRACED: ContextVar[bool] = ContextVar("memfit_traced_first_steps", default=False)
_SCALER = "scaler"


class NotMade(Exception):
    """A first step this module cannot make (Note 2): trace it."""


@contextlib.contextmanager
def traced_first_steps():
    """Trace every first step instead of making it (Note 2)."""
    token = _TRACED.set(True)
    try:
        yield
    finally:
        _TRACED.reset(token)


def may_make(optimizer) -> bool:
    """Whether the first step of a step with ``optimizer`` may be made (Note 2)."""
    inner = _stepping(optimizer)
    return not _TRACED.get() and (makes_state_in_init_group(inner) or _bnb_fused(inner))


def _stepping(optimizer):
    """The optimizer that makes the state: ``optimizer``, or the one a wrapper whose own step is
    the same every step steps (``steady_inner()``: bf16-pure's master weights, Note 4)."""
    while callable(getattr(optimizer, "steady_inner", None)):
        optimizer = optimizer.steady_inner()
    return optimizer


def _bnb_fused(optimizer) -> bool:
    """bitsandbytes' 8-bit step on its fused CUDA kernel (``trace.cuda``), its ``step`` its
    own (Note 3)."""
    mod = sys.modules.get("bitsandbytes.optim.optimizer")
    return mod is not None and isinstance(optimizer, mod.Optimizer8bit) and \
        inspect.unwrap(type(optimizer).step) is inspect.unwrap(mod.Optimizer8bit.step) and \
        getattr(optimizer, "cuda_kernel", False) is True and \
        not (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or
             _global_optimizer_pre_hooks or _global_optimizer_post_hooks)


def _group_tag(g: int) -> str:
    return f"optimizer group {g}"


class Recorder:
    """What ``make`` needs, recorded around the counted step (Note 1): ``on_state`` before it
    (inside the tracker), ``after_step`` once it has run."""

    def __init__(self, model, optimizer, scaler):
        self.model, self.optimizer, self.scaler = model, _stepping(optimizer), scaler
        self.per_group = makes_state_in_init_group(self.optimizer)  # else per parameter (Note 3)
        self.tracker = None
        self._names: dict[int, str] = {}
        self._grads: list[tuple[object, int]] = []     # (parameter, its gradient's entry sid)
        self._undo: list = []

    def on_state(self, tracker) -> None:
        """Tag the state the first step makes, pair each gradient with its parameter, and mark
        where ``_init_group`` and the first ``scale()`` run."""
        self.tracker = tracker
        led = tracker.ledger
        first = led.first

        def sids(t):
            return [s for s in (led.sid(st) for st in led.storages(t)) if s in led._entry]

        self._names = {id(p): name for name, p in self.model.named_parameters()}
        params = {id(p): p for p in self.model.parameters()}
        maps = {sid for v in getattr(self.optimizer, "name2qmap", {}).values()
                for sid in sids(v)}                # bitsandbytes' maps: made with it
        first.older |= maps
        first.late |= maps
        for g, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in params:           # master weights, made with it (Note 4)
                    first.older.update(sids(p))
                    params[id(p)] = p
                tag = _group_tag(g) if self.per_group else self._names.get(id(p))
                for v in tree_flatten(self.optimizer.state.get(p, {}))[0]:
                    for sid in sids(v) if isinstance(v, torch.Tensor) else ():
                        if sid not in maps and tag is not None:
                            first.made.setdefault(sid, tag)
        for p in params.values():                 # the model's and the masters' gradients
            if p.grad is not None:
                self._grads += [(p, sid) for sid in sids(p.grad)]
        if self.scaler is not None and self.scaler._scale is not None:
            for t in (self.scaler._scale, self.scaler._growth_tracker):
                led.mark_tensor(t, TEMPORARIES, entry=True)   # the first step makes them
                for sid in sids(t):
                    first.made[sid] = _SCALER
        self._patch()

    def _mark(self, tag: str) -> None:
        t = self.tracker
        t.marks.append(("first", tag, "", t.ledger.num_events, len(t.op_events)))

    def _patch(self) -> None:
        opt, scaler = self.optimizer, self.scaler
        if self.per_group:
            init = opt._init_group

            def init_group(group, *args, **kwargs):
                g = next(i for i, q in enumerate(opt.param_groups) if q is group)
                self._mark(_group_tag(g))
                return init(group, *args, **kwargs)
            opt._init_group = init_group
            self._undo.append(lambda: opt.__dict__.pop("_init_group", None))
        else:
            update = opt.update_step

            def update_step(group, p, *args, **kwargs):
                self._mark(self._names.get(id(p), "?"))
                return update(group, p, *args, **kwargs)
            opt.update_step = update_step
            self._undo.append(lambda: opt.__dict__.pop("update_step", None))
        if scaler is None:
            return
        scale, seen = scaler.scale, []

        def first_scale(outputs):
            if not seen:
                seen.append(True)
                self._mark(_SCALER)
            return scale(outputs)
        scaler.scale = first_scale
        self._undo.append(lambda: scaler.__dict__.pop("scale", None))

    def after_step(self) -> None:
        """Pair each gradient alive before the step with the one the step made for the same
        parameter, and take the marks' hooks off."""
        for undo in self._undo:
            undo()
        self._undo = []
        if self.tracker is None:
            return
        led = self.tracker.ledger
        for p, entry in self._grads:
            if p.grad is None:
                continue
            made = [led.sid(st) for st in led.storages(p.grad)]
            if len(made) == 1 and made[0] is not None and made[0] != entry:
                led.first.grads[entry] = made[0]


def make(tracker) -> None:
    """Put the first step, made from the counted one, on ``tracker``'s ledger (Note 1), or
    raise ``NotMade`` (Note 2)."""
    led = tracker.ledger
    first = led.first
    made, grads, entries = first.made, first.grads, led._entry
    if first.events is not None:
        return
    reached = Counter(m[1] for m in tracker.marks if m[0] == "first")
    by_tag: dict[str, list[int]] = {}
    for sid in entries:
        if sid in made:
            by_tag.setdefault(made[sid], []).append(sid)
    for tag in by_tag:
        if reached[tag] != 1:
            raise NotMade(f"the step reached {tag} {reached[tag]} times")
    for sid in entries:
        category = led._category[sid]
        if category == OPTIMIZER and sid not in made and sid not in first.older and \
                sid not in grads:              # (host gradients count as the optimizer's)
            raise NotMade("optimizer state the first step does not make as torch's Adam does")
        if category == GRADS and sid not in grads:
            raise NotMade("a gradient alive before the step that the step makes no other of")
    partner = {b: e for e, b in grads.items()}
    for b, e in partner.items():
        if b in entries or led._nbytes[b] != entries[e]:
            raise NotMade("a gradient the step makes is not like the one alive before it")
    events: list[tuple[int, int, bool]] = []
    op_events: list[int] = []             # the first step's events after each of its ops
    fresh: dict[int, int] = {}
    alive: set[int] = set()
    # what happened between the counted step's events, in order: its ops' ends (an op ends
    # once its events are in) and the marks, each at (events so far, ops so far)
    between = sorted([(e, j + 1, 0, "") for j, e in enumerate(tracker.op_events)] +
                     [(m[3], m[4], 1, m[1]) for m in tracker.marks if m[0] == "first"])
    nxt = 0

    def flush(upto: int) -> None:
        nonlocal nxt
        while nxt < len(between) and between[nxt][0] <= upto:
            _, _, is_mark, tag = between[nxt]
            if is_mark:
                events.extend((sid, entries[sid], False) for sid in by_tag.get(tag, ()))
            else:
                op_events.append(len(events))
            nxt += 1

    for i, (s, d) in enumerate(zip(led._ev_sid, led._ev_delta)):
        flush(i)
        resize = i in led._resizes
        if s in grads and d < 0 and not resize:
            continue                        # its zero_grad frees a gradient step 1 has not
        if s in entries:
            raise NotMade("the step frees or resizes a storage alive before it (the weights "
                          "parameter offload releases)")
        if s in partner:
            s1 = partner[s]
        elif s in fresh:
            s1 = fresh[s]
        elif d > 0 and not resize:            # its own id, like the counted step's
            s1 = fresh[s] = led.add_unseen(led._nbytes[s], led._category[s],
                                           host=s in led._host, unified=s in led._unified)
        else:
            raise NotMade("the step changes a storage it did not make")
        if d > 0 and not resize:
            alive.add(s1)
        elif d < 0 and not resize:
            alive.discard(s1)
        events.append((s1, d, resize))
    flush(led.num_events)
    if alive - set(partner.values()):
        raise NotMade("the step leaves alive a storage it made that is no gradient (a cache "
                      "its first call fills?)")
    if set(partner.values()) - alive:
        raise NotMade("a gradient the step makes does not outlive it")
    first.events, first.op_events = events, op_events
