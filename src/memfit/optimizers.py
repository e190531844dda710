"""Optimizers by name, and rebuilding a user's optimizer over other (e.g. fake) parameters."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable

import torch

__all__ = ["OPTIMIZERS", "optimizer_factory", "rebuild_optimizer"]

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


def optimizer_factory(spec) -> Callable[[Iterable], torch.optim.Optimizer]:
    """A factory ``params -> Optimizer`` from a name, a factory, or an optimizer instance."""
    if isinstance(spec, str):
        key = spec.lower()
        if key not in OPTIMIZERS:
            close = difflib.get_close_matches(key, OPTIMIZERS, n=3)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"unknown optimizer {spec!r}; known: {', '.join(OPTIMIZERS)}.{hint}")
        return OPTIMIZERS[key]
    if isinstance(spec, torch.optim.Optimizer):
        return lambda params: rebuild_optimizer(spec, params)
    if callable(spec):
        return spec
    raise ValueError(
        f"optimizer must be a name ({', '.join(OPTIMIZERS)}), an optimizer instance or a "
        f"factory params -> optimizer; got {type(spec).__name__}"
    )


def rebuild_optimizer(optimizer: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters over ``params``.

    ``params`` is a flat list matching the instance's parameters in group order, or a dict
    mapping ``id(old_param)`` to the new one. State is not copied.
    """
    params = list(params) if not isinstance(params, dict) else params
    groups, i = [], 0
    for group in optimizer.param_groups:
        new = dict(group)
        if isinstance(params, dict):
            new["params"] = [params[id(p)] for p in group["params"]]
        else:
            new["params"] = params[i:i + len(group["params"])]
            i += len(group["params"])
        groups.append(new)
    return type(optimizer)(groups, **optimizer.defaults)
