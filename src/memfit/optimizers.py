"""Optimizers by name, and rebuilding a user's optimizer over other (fake, bf16-master, ...)
parameters or with another implementation (``optimizer_impl``).

Note 1 (implementations). A torch optimizer steps in one of four ways, with the same math:
``foreach`` (each op over all parameters at once: temporaries the size of every parameter
together, CUDA's default), ``fused`` (one kernel per group: no parameter-sized temporaries;
only classes whose constructor takes ``fused``), a for-loop (``foreach=False``: one
parameter's temporaries at a time; the default for CPU tensors) or ``compiled`` (its step under
``torch.compile``, PyTorch's ``opt.step = torch.compile(opt.step)``: built as given, the step
compiled by ``techniques.compiled_optimizer``). ``impl_of`` reads which one an optimizer will
run; ``OptimizerRecipe(spec, impl=...)`` builds it with another. A recipe with ``impl=None``
builds the optimizer as given (an instance keeps its own implementation).
"""

from __future__ import annotations

import difflib
import inspect
import sys
from collections.abc import Callable, Iterable

import torch

__all__ = ["OPTIMIZERS", "OptimizerRecipe", "rebuild_optimizer", "impl_of", "supports_impl",
           "IMPL_FLAGS", "compiled_step"]

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


# optimizer_impl -> the constructor flags that select it (Note 1)
IMPL_FLAGS: dict[str, dict[str, bool]] = {
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
    "for-loop": {"foreach": False, "fused": False},
    "compiled": {},                  # as given, its step compiled
}


def supports_impl(cls: type, impl: str) -> bool:
    """``cls``'s constructor can select ``impl`` (Note 1)."""
    accepted = inspect.signature(cls.__init__).parameters
    return all(flag in accepted for flag, on in IMPL_FLAGS[impl].items() if on) and \
        "foreach" in accepted


def impl_of(optimizer, cuda: bool) -> str | None:
    """The implementation ``optimizer`` will run (Note 1): what its groups ask for, else the
    default for its parameters' device (``cuda``: the target is a GPU). None: not a torch
    optimizer with these flags."""
    inner = getattr(optimizer, "inner", optimizer)
    groups = getattr(inner, "param_groups", None)
    if not groups or "foreach" not in groups[0]:
        return None
    if compiled_step(inner) is not None:
        return "compiled"
    g = groups[0]
    if g.get("fused"):
        return "fused"
    if g["foreach"] is None:
        return "foreach" if cuda else "for-loop"
    return "foreach" if g["foreach"] else "for-loop"


def compiled_step(optimizer):
    """The optimizer's ``step`` where it was replaced by a compiled one
    (``opt.step = torch.compile(opt.step)``, Note 1), else None."""
    step = vars(optimizer).get("step") if hasattr(optimizer, "__dict__") else None
    return step if callable(step) and hasattr(step, "_torchdynamo_orig_callable") else None


class OptimizerRecipe:
    """How to make the user's optimizer over new parameters.

    ``spec`` is a name (see ``OPTIMIZERS``), a factory ``params -> Optimizer``, or an optimizer
    instance (rebuilt from its class, hyper-parameters and param groups; its state is not
    copied). ``build(params, origin)`` makes one over ``params``, which replace ``origin``
    one for one (the user's parameters, in the same order). ``impl`` (a ``Knobs.optimizer_impl``
    value): build it with that implementation (Note 1); ``None`` builds it as given.
    """

    def __init__(self, spec, impl: str | None = None):
        self.spec, self.impl = spec, impl
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

    def with_impl(self, impl: str | None) -> "OptimizerRecipe":
        """The same recipe building ``impl`` (None: as given)."""
        return self if impl == self.impl else OptimizerRecipe(self.spec, impl)

    def optimizer_class(self, params: list[torch.Tensor]) -> type:
        """The class this recipe builds (a factory is called once over ``params``)."""
        if self.instance is not None:
            return type(self.instance)
        return type(self.factory(params))

    def check_impl(self, params: list[torch.Tensor]) -> None:
        """A ValueError naming the fix when the optimizer cannot run ``impl``."""
        if self.impl is None:
            return
        cls = self.optimizer_class(params)
        if not supports_impl(cls, self.impl):
            others = [i for i in IMPL_FLAGS if supports_impl(cls, i)]
            raise ValueError(f"optimizer_impl={self.impl!r}: {cls.__name__} has no {self.impl} "
                             f"implementation; use one of {', '.join(others) or 'none'} or "
                             "leave optimizer_impl unset")

    def build(self, params: list[torch.Tensor], origin: list[torch.Tensor]) -> torch.optim.Optimizer:
        if self.instance is None:
            opt = self.factory(params)
            return opt if self.impl is None else self._with_impl(opt, {id(p): p for p in params})
        if all(n is o for o, n in zip(origin, params)):
            if self.impl is None or impl_of(self.instance, cuda=_on_cuda(params)) == self.impl:
                return self.instance        # same parameters: the user's optimizer as it is
            return self._with_impl(self.instance, {id(p): p for p in params})
        new_of = {id(o): n for o, n in zip(origin, params)}
        if self.impl is None:
            return rebuild_optimizer(self.instance, new_of)
        return self._with_impl(self.instance, new_of)

    def _with_impl(self, optimizer, new_of: dict[int, torch.Tensor]):
        self.check_impl(list(new_of.values()))
        return rebuild_optimizer(optimizer, new_of, IMPL_FLAGS[self.impl])

    def check_params(self, model_params: list[torch.Tensor]) -> None:
        """An instance must optimize only the model's parameters (else: a clear error)."""
        if self.instance is None:
            return
        offload = sys.modules.get("torchao.optim.cpu_offload")
        if offload is not None and isinstance(self.instance, offload.CPUOffloadOptimizer):
            raise ValueError(
                "torchao's CPUOffloadOptimizer steps its own host copies, which memfit does not "
                "rebuild: pass its optimizer_class and keyword arguments as the optimizer (e.g. "
                "lambda ps: torch.optim.AdamW(ps, lr=1e-4)) with offload_optimizer=True, and "
                "offload_gradients=True if you set it there: memfit's optimizer offload does "
                "the same (every parameter on the host, where torchao keeps those under "
                "minimal_size on the device)")
        known = {id(p) for p in model_params}
        stray = sum(id(p) not in known for g in self.instance.param_groups for p in g["params"])
        if stray:
            raise ValueError(f"the optimizer holds {stray} tensor(s) that are not trainable "
                             "parameters of the model: build it from model.parameters()")


def rebuild_optimizer(optimizer: torch.optim.Optimizer, new_of: dict[int, torch.Tensor],
                      flags: dict | None = None, cls: type | None = None):
    """The same optimizer class and hyper-parameters, each param replaced by ``new_of[id(p)]``;
    ``flags`` (e.g. ``IMPL_FLAGS["fused"]``) override those keys in every group. ``cls``: build
    this subclass of the optimizer's class instead."""
    cls = cls or type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    flags = {k: v for k, v in (flags or {}).items() if k in accepted}
    groups = []
    for group in optimizer.param_groups:
        new = dict(group) | flags
        new["params"] = [new_of[id(p)] for p in group["params"]]
        groups.append(new)
    # defaults may hold keys the constructor does not take (AdamW's decoupled_weight_decay);
    # every group already carries them all
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted} | flags
    return cls(groups, **defaults)


def _on_cuda(params) -> bool:
    return any(p.device.type == "cuda" for p in params)
