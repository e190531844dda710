"""Mixed precision: autocast fp16/bf16, and pure bf16 weights with fp32 master weights.

Note 1 (bf16-pure). The model's parameters (and gradients) are bf16; a fp32 copy of each
trainable parameter (the master weight) is what the optimizer updates. Each step converts the
bf16 gradients to fp32 master gradients, steps the inner optimizer, copies the masters back
into the bf16 parameters and frees the master gradients. The masters are made before the model
is cast, so they start from the exact fp32 values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from memfit.knobs import PRECISIONS
from memfit.optimizers import OptimizerRecipe
from memfit.techniques._protocol import Change

__all__ = ["Precision", "MasterWeightsOptimizer", "cast_floating"]

_AUTOCAST_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}
_PURE_NOTE = ("bf16-pure: the optimizer was rebuilt over fp32 master weights (runner.optimizer); "
              "the one passed in is no longer used")


class MasterWeightsOptimizer:
    """An optimizer over fp32 master copies of bf16 parameters (Note 1)."""

    def __init__(self, params, masters, inner):
        self.params = list(params)           # the model's bf16 parameters
        self.masters = list(masters)         # their fp32 copies, in the same order
        self.inner = inner                   # the user's optimizer, over the masters

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self):
        return self.inner.defaults

    def register_step_post_hook(self, hook):
        return self.inner.register_step_post_hook(hook)

    def steady_inner(self):
        """The optimizer whose first step differs from its next: this one's own step is the
        same in every step (trace.first_step)."""
        return self.inner

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
        self.inner.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
            m.grad = None

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "masters": [m.detach() for m in self.masters]}

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)


class Precision:
    """Numerics of the step: which autocast to run under, and whether weights become bf16."""

    @dataclass(frozen=True)
    class Config:
        mode: str = "fp32"   # one of "fp32", "fp16", "bf16", "bf16-pure"

        def __post_init__(self):
            if self.mode not in PRECISIONS or self.mode == "auto":
                raise ValueError(f"Precision.Config.mode={self.mode!r} must be one of "
                                 "fp32, fp16, bf16, bf16-pure")

    def __init__(self, config: "Precision.Config", autocast_impl=None):
        self.config = config
        # dtype -> context manager; default torch.autocast on the model's device. A trace for
        # a CUDA target passes a model of CUDA's autocast instead.
        self.autocast_impl = autocast_impl

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast runs in, or None when this precision uses no autocast."""
        return _AUTOCAST_DTYPE.get(self.config.mode)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        dtype = _AUTOCAST_DTYPE.get(self.config.mode)
        if dtype is None:
            return contextlib.nullcontext()
        if self.autocast_impl is not None:
            return self.autocast_impl(dtype)
        return torch.autocast(device_type, dtype=dtype)

    def prepare_batch(self, batch):
        """bf16-pure: floating-point inputs become bf16 like the weights (others pass)."""
        if self.config.mode != "bf16-pure":
            return batch
        return tree_map(lambda x: x.to(torch.bfloat16)
                        if isinstance(x, torch.Tensor) and x.is_floating_point() else x, batch)

    def apply(self, model: nn.Module, recipe: OptimizerRecipe,
              origin: list[torch.Tensor] | None = None) -> Change:
        """Build the optimizer by ``recipe`` over the model's trainable parameters, which
        replace ``origin`` (default: themselves): the ``Change``'s ``optimizer``. bf16-pure
        casts ``model`` in place (Note 1; ``remove()`` does not cast it back) and rebuilds the
        optimizer over the fp32 master weights."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        origin = trainable if origin is None else origin
        if self.config.mode != "bf16-pure":
            return Change(model, optimizer=recipe.build(trainable, origin))
        masters = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in trainable]
        inner = recipe.build(masters, origin)     # first: if it fails, the model is untouched
        new = cast_floating(model, torch.bfloat16)
        optimizer = MasterWeightsOptimizer([new[id(p)] for p in trainable], masters, inner)
        return Change(model, optimizer=optimizer, optimizer_rebuilt=True, notes=(_PURE_NOTE,))


def cast_floating(model: nn.Module, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Replace every floating parameter and buffer of ``model`` by a ``dtype`` copy.

    Tied parameters stay tied. Returns ``id(old) -> new``. (Not ``model.to(dtype)``: that swaps
    tensor subclasses in place, which fake tensors refuse.)
    """
    new: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in slots.items():
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in new:
                    data = t.detach().to(dtype)
                    new[id(t)] = (nn.Parameter(data, requires_grad=t.requires_grad)
                                  if isinstance(t, nn.Parameter) else data)
                slots[name] = new[id(t)]
    return new
