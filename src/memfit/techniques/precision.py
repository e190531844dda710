"""Mixed precision: autocast fp16/bf16, and pure bf16 weights with fp32 master weights.

Note 1 (bf16-pure). The model's parameters (and gradients) are bf16; a fp32 copy of each
trainable parameter (the master weight) is what the optimizer updates. Each step converts the
bf16 gradients to fp32 master gradients, steps the inner optimizer, copies the masters back
into the bf16 parameters and frees the master gradients. The masters are made before the model
is cast, so they start from the exact fp32 values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memfit.knobs import PRECISIONS

__all__ = ["Precision", "MasterWeightsOptimizer"]

_AUTOCAST_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


class MasterWeightsOptimizer:
    """An optimizer over fp32 master copies of bf16 parameters (Note 1)."""

    def __init__(self, params, factory: Callable):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in self.params]
        self.inner = factory(self.masters)

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

    def __init__(self, config: "Precision.Config"):
        self.config = config

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        dtype = _AUTOCAST_DTYPE.get(self.config.mode)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=dtype)

    def apply(self, model: nn.Module, optimizer_factory: Callable):
        """Return ``(model, optimizer)``; bf16-pure casts ``model`` in place (Note 1)."""
        if self.config.mode != "bf16-pure":
            return model, optimizer_factory(model.parameters())
        opt = MasterWeightsOptimizer(model.parameters(), optimizer_factory)
        model.to(torch.bfloat16)
        return model, opt
