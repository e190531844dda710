"""The optimizer step fused into backward: each parameter is stepped, and its gradient freed, as
soon as its gradient is ready (torchtune's ``register_optim_in_bwd_hooks``).

Note 1 (the mechanism). The user's optimizer (class, hyper-parameters, param groups; built by
the ``OptimizerRecipe``, so an instance, a name, a factory or a low-bit state) is split into
one optimizer per parameter, each over one group holding that parameter alone with its group's
hyper-parameters (``rebuild_optimizer``; bitsandbytes' with its ``args`` and the parameter's
own overrides, ``rebuild_bnb``). A ``register_post_accumulate_grad_hook`` on the parameter runs
its optimizer's ``step()`` and ``zero_grad(set_to_none=True)`` as soon as autograd has
accumulated the parameter's gradient (once per backward, tied weights included: autograd sums a
leaf's incoming gradients before its one accumulation). So the full set of gradients never
exists: while backward runs, at most the gradients of the parameters whose accumulation is
under way are alive, plus the one being stepped and its step's temporaries; the previous step's
gradients do not exist when the forward runs. The saving against the plain step is about every
gradient but the largest (measured: docs/techniques/optimizer-in-backward.md). The math of each
update is the per-parameter step of the same class: for a for-loop (``foreach=False``)
optimizer whose update of a parameter reads only its own state (SGD, Adam(W), RMSprop,
bitsandbytes' and torchao's Adam) it is the plain step's, bitwise.

Note 2 (the wrapper). ``InBackwardOptimizer`` is the optimizer the loop holds (a
``torch.optim.Optimizer``: LR schedulers take it). Its ``param_groups`` are the user's groups;
each hook copies its group's hyper-parameters (every key but "params") into the parameter's
optimizer before stepping, so a scheduler's write of ``lr`` reaches every per-parameter
optimizer at its next step. ``step()`` steps only the parameters that still have a gradient
(none after a backward, where the hooks stepped them all; a gradient set by hand, or the
trace's warm-up) and ``zero_grad()`` frees only what is left: neither does what the hooks did.
``state`` is the per-parameter states keyed by parameter; ``state_dict()`` is torch's format
for a plain optimizer over the same groups (a plain one can load it, and this loads a plain
one's), each parameter's entry made and loaded by its own optimizer (so bitsandbytes' and
torchao's states keep their types). An optimizer that already has state hands it over. A hook
holds the wrapper weakly: a parameter's hooks are not seen by the garbage collector, so a strong
reference (parameter -> hook -> wrapper -> its optimizers -> parameter) would keep a dropped
model, its optimizers and their state alive for good; once the wrapper is gone (its Runner
dropped) the hooks do nothing and gradients accumulate as without them.

Note 3 (what is refused, and why). Anything that needs every gradient at once after backward,
or that steps later than backward: gradient accumulation (a micro-batch's hooks would step on a
partial gradient; ``micro_batch_size`` must be the whole batch), ``max_grad_norm`` (a global
norm reads every gradient), fp16 (a GradScaler's ``unscale_`` and inf check read every gradient
before the step; bf16 autocast needs none), bf16-pure (its fp32 masters are stepped from the
bf16 gradients after backward), ``offload_optimizer`` (its host step copies gradients after
backward), several GPUs (DDP and FSDP2 reduce gradients in buckets after the hooks would have
stepped on local ones), ``zero_grad="keep-buffers"`` (the buffers it keeps are the gradients
the hooks free), DTR (``remat``: its out-of-memory retry assumes the parameters are untouched
until the step), and a user's ``step=fn`` (its loop calls ``optimizer.step()`` itself). For
the same reason memfit's out-of-memory re-plan is off: a batch that runs out of memory in
backward has already stepped some parameters.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from memfit.knobs import Knobs
from memfit.measure.track import gradient_ready
from memfit.optimizers import OptimizerRecipe, rebuild_optimizer
from memfit.techniques._bnb_optimizer import BnbStep, is_bnb, rebuild_bnb
from memfit.techniques._protocol import Change

__all__ = ["OptimizerInBackward", "InBackwardOptimizer", "check_knobs", "NOTE"]

NOTE = ("optimizer_in_backward: the optimizer was split into one per parameter "
        "(runner.optimizer), each stepped by its parameter's post-accumulate-grad hook as soon "
        "as the gradient is ready, which then frees it; the one passed in is no longer stepped")


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, stepped in backward by the hooks (Notes 1, 2).

    ``full``: the user's optimizer as built (a torch optimizer over the parameters to train).
    ``optimizers``: parameter -> its own optimizer (a dict keyed by ``id``)."""

    steps_in_backward = True    # trace.profile's warm-up leaves no gradient behind (Note 2)

    def __init__(self, full: torch.optim.Optimizer):
        source = full
        if is_bnb(full) and not isinstance(full, BnbStep):    # overrides resolved by position
            full = rebuild_bnb(full, {id(p): p for g in full.param_groups for p in g["params"]})
        super().__init__([dict(g) for g in full.param_groups], full.defaults)
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self._group_of: dict[int, dict] = {}
        for gi, group in enumerate(full.param_groups):
            for pi, p in enumerate(group["params"]):
                self.optimizers[id(p)] = _one_param(full, gi, pi, p)
                self._group_of[id(p)] = self.param_groups[gi]
        self.state = _States(self)
        if source.state:                       # Note 2: its state carries over
            self.load_state_dict(source.state_dict())

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """``p``'s own step, then its gradient freed (the hook, Note 1)."""
        gradient_ready(p)               # a running track counts it as a gradient
        opt = self.optimizers[id(p)]
        inner = opt.param_groups[0]
        for key, value in self._group_of[id(p)].items():     # Note 2
            if key != "params":
                inner[key] = value
        opt.step()
        opt.zero_grad(set_to_none=True)

    def step(self, closure=None):
        """Step the parameters the hooks have not stepped (those with a gradient, Note 2)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p in self.params:
            if p.grad is not None:
                self.step_param(p)
        return loss

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "optimizers"):       # Optimizer.__init__ adding the groups
            return super().add_param_group(param_group)
        raise NotImplementedError("InBackwardOptimizer cannot take new param groups: build the "
                                  "optimizer with them all before optimizer_in_backward")

    def state_dict(self) -> dict:
        """torch's format for a plain optimizer over these groups (Note 2)."""
        state, groups, index = {}, [], 0
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                own = self.optimizers[id(p)].state_dict()["state"]
                if own:
                    state[index] = own[0]
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Load this class's or a plain optimizer's state dict, each parameter's entry by its
        own optimizer (Note 2)."""
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in saved_groups]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"the state dict's param groups hold {sizes} parameters; this "
                             f"optimizer's hold {[len(g['params']) for g in self.param_groups]}")
        for group, saved in zip(self.param_groups, saved_groups):
            hyper = {k: v for k, v in saved.items() if k != "params"}
            for p, i in zip(group["params"], saved["params"]):
                own = state_dict["state"].get(i)
                self.optimizers[id(p)].load_state_dict(
                    {"state": {} if own is None else {0: own},
                     "param_groups": [{**hyper, "params": [0]}]})
            group.update(hyper)


def _one_param(full: torch.optim.Optimizer, gi: int, pi: int, p: torch.Tensor):
    """``full``'s class and group ``gi``'s hyper-parameters over ``p`` alone (Note 1)."""
    view = object.__new__(type(full))     # full as if its only group held p: what rebuild reads
    vars(view).update(vars(full), param_groups=[{**full.param_groups[gi], "params": [p]}])
    if not is_bnb(full):
        return rebuild_optimizer(view, {id(p): p})
    one = rebuild_bnb(view, {id(p): p})
    own = full.overrides.get((gi, pi))
    one.overrides = {(0, 0): own} if own else {}
    return one


class _States(Mapping):
    """The per-parameter optimizers' states, keyed by parameter (read-only; Note 2)."""

    def __init__(self, wrapper: InBackwardOptimizer):
        self._wrapper = wrapper

    def __getitem__(self, p):
        opt = self._wrapper.optimizers.get(id(p))
        if opt is None or p not in opt.state:
            raise KeyError(p)
        return opt.state[p]

    def __iter__(self):
        return (p for p in self._wrapper.params if p in self._wrapper.optimizers[id(p)].state)

    def __len__(self):
        return sum(1 for _ in self)


def check_knobs(knobs: Knobs, batch_size: int | None = None) -> None:
    """What cannot run with the step in backward (Note 3): a ValueError naming the fix.
    ``batch_size``: the effective batch's samples (None: not known here; each front checks
    ``micro_batch_size`` against its batch)."""
    if not knobs.optimizer_in_backward:
        return
    mbs = knobs.micro_batch_size
    if mbs is not None and batch_size is not None and mbs < batch_size:
        raise ValueError(f"optimizer_in_backward with micro_batch_size={mbs} of a batch of "
                         f"{batch_size}: gradient "
                         "accumulation needs every micro-batch's gradient before the step, which "
                         "the hooks take as soon as one is ready; leave micro_batch_size unset "
                         "(the whole batch), or optimizer_in_backward off")
    refused = (
        ("max_grad_norm", knobs.max_grad_norm is not None,
         "clipping to a global norm reads every gradient before the step; leave max_grad_norm "
         "unset"),
        ("precision='fp16'", knobs.precision == "fp16",
         "a GradScaler unscales and checks every gradient before the step; use precision="
         "'bf16' (no loss scaling)"),
        ("precision='bf16-pure'", knobs.precision == "bf16-pure",
         "its fp32 master weights are stepped from the bf16 gradients after backward; use "
         "precision='bf16' (autocast)"),
        ("offload_optimizer", bool(knobs.offload_optimizer),
         "the host step copies every gradient after backward; use one or the other"),
        ("several GPUs", knobs.gpus not in (None, 1) or knobs.sharding not in (None, "none"),
         "DDP and FSDP2 reduce gradients after the hooks would have stepped on this rank's; "
         "leave gpus and sharding unset"),
        ("zero_grad='keep-buffers'", knobs.zero_grad == "keep-buffers",
         "the buffers it keeps are the gradients the hooks free; leave zero_grad unset"),
        ("remat", bool(knobs.remat),
         "DTR's retry after running out of memory assumes no parameter was stepped yet; leave "
         "remat unset"),
    )
    for what, bad, fix in refused:
        if bad:
            raise ValueError(f"optimizer_in_backward with {what} is not supported: {fix}, or "
                             "turn optimizer_in_backward off")


class OptimizerInBackward:
    """Step each parameter, and free its gradient, in backward (Notes 1-3)."""

    @dataclass(frozen=True)
    class Config:
        enabled: bool = True

        def __post_init__(self):
            if not isinstance(self.enabled, bool):
                raise ValueError(f"OptimizerInBackward.Config.enabled={self.enabled!r} must be "
                                 "True or False")

    def __init__(self, config: "OptimizerInBackward.Config"):
        self.config = config

    def apply(self, model: nn.Module, optimizer) -> Change:
        """Split ``optimizer`` (an ``OptimizerRecipe``, or what one takes: an instance over the
        model's trainable parameters, a name, a factory) into one per parameter and hook each
        parameter (Note 1). The ``Change``'s ``optimizer`` is the ``InBackwardOptimizer`` to hold
        (disabled: the optimizer as built); its hooks are the parameters'."""
        recipe = optimizer if isinstance(optimizer, OptimizerRecipe) else \
            OptimizerRecipe(optimizer)
        params = [p for p in model.parameters() if p.requires_grad]
        full = recipe.build(params, params)
        if not self.config.enabled:
            return Change(model, optimizer=full)
        known = {id(p) for p in params}
        if not isinstance(full, torch.optim.Optimizer) or isinstance(full, InBackwardOptimizer) \
                or any(id(p) not in known for g in full.param_groups for p in g["params"]):
            raise ValueError(f"optimizer_in_backward splits a torch optimizer over the model's "
                             f"trainable parameters; got a {type(full).__name__} that is not one "
                             "(bf16-pure's masters, an offloaded or already split optimizer)")
        return _hooked(model, InBackwardOptimizer(full))


def _hooked(model: nn.Module, wrapper: InBackwardOptimizer) -> Change:
    """``wrapper``'s hooks on its parameters, each holding it weakly (Note 2); ``reapply()``
    hooks the same wrapper again (its optimizers and state kept)."""
    ref = weakref.ref(wrapper)

    def hook(p: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live.step_param(p)

    hooks = [p.register_post_accumulate_grad_hook(hook) for p in wrapper.params]
    return Change(model, optimizer=wrapper, optimizer_rebuilt=True, notes=(NOTE,), hooks=hooks,
                  redo=lambda: _hooked(model, wrapper))
