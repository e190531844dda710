"""Optimizers by name, and rebuilding a user's optimizer over other (fake, bf16-master, ...)
parameters."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable

import torch

__all__ = ["OPTIMIZERS", "OptimizerRecipe", "rebuild_optimizer"]

# name -> factory(params). Hyper-parameters are the usual fine-tuning ones; they do not change
# memory, only the state each optimizer keeps does.
OPTIMIZERS: dict[str, Callable[[Iterable], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
}


class OptimizerRecipe:
    """How to make the user's optimizer over new parameters.

    ``spec`` is a name (see ``OPTIMIZERS``), a factory ``params -> Optimizer``, or an optimizer
    instance (rebuilt from its class, hyper-parameters and param groups; its state is not
    copied). ``build(params, origin)`` makes one over ``params``, which replace ``origin``
    one for one (the user's parameters, in the same order).
    """

    def __init__(self, spec):
        self.instance = spec if isinstance(spec, torch.optim.Optimizer) else None
        if isinstance(spec, str):
            key = spec.lower()
            if key not in OPTIMIZERS:
                close = difflib.get_close_matches(key, OPTIMIZERS, n=3)
                hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise ValueError(f"unknown optimizer {spec!r}; known: {', '.join(OPTIMIZERS)}.{hint}")
            self.factory = OPTIMIZERS[key]
        elif self.instance is not None:
            self.factory = None
        elif callable(spec):
            self.factory = spec
        else:
            raise ValueError(
                f"optimizer must be a name ({', '.join(OPTIMIZERS)}), an optimizer instance or a "
                f"factory params -> optimizer; got {type(spec).__name__}")

    def build(self, params: list[torch.Tensor], origin: list[torch.Tensor]) -> torch.optim.Optimizer:
        if self.instance is None:
            return self.factory(params)
        if all(n is o for o, n in zip(origin, params)):
            return self.instance            # same parameters: the user's optimizer as it is
        return rebuild_optimizer(self.instance, {id(o): n for o, n in zip(origin, params)})

    def check_params(self, model_params: list[torch.Tensor]) -> None:
        """An instance must optimize only the model's parameters (else: a clear error)."""
        if self.instance is None:
            return
        known = {id(p) for p in model_params}
        stray = sum(id(p) not in known for g in self.instance.param_groups for p in g["params"])
        if stray:
            raise ValueError(f"the optimizer holds {stray} tensor(s) that are not trainable "
                             "parameters of the model: build it from model.parameters()")


def rebuild_optimizer(optimizer: torch.optim.Optimizer, new_of: dict[int, torch.Tensor]):
    """The same optimizer class and hyper-parameters, each param replaced by ``new_of[id(p)]``."""
    groups = []
    for group in optimizer.param_groups:
        new = dict(group)
        new["params"] = [new_of[id(p)] for p in group["params"]]
        groups.append(new)
    # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay);
    # every group already carries them all
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
