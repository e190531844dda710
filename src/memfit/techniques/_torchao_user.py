"""A user's own torchao optimizer (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``, their Adam
versions, ``_AdamW``; the HF Trainer's ``optim="adamw_torch_8bit"``/``"adamw_torch_4bit"``),
rebuilt over other parameters and traced as torchao runs it: compiled.

Note 1 (the rebuild). A trace rebuilds the optimizer over fake parameters. ``rebuild_torchao``
builds its class over the new parameters with the same param groups and hyper-parameters
(torchao's tensor ``lr`` read as a float outside every mode: a real tensor cannot meet a fake
one), ``block_size`` and ``bf16_stochastic_round``, and torchao's own ``_new_buffer``, so its
rule for which tensors are quantized (at least 4096 values, a multiple of the block; the others
keep moments in the parameter's dtype) is torchao's. How the rebuilt class steps is the
caller's choice (``STEPS``): as torchao steps it, compiled (a trace of the user's optimizer,
Note 2); eagerly (memfit's host step under ``optimizer_offload``, and an optimizer that already
steps eagerly, memfit's own classes: a trace and the run share it, ``_torchao_optimizer``); or
torchao's own class (a real run over new parameters). Over
the user's own parameters (a real run) the user's instance steps as it is. ``TorchaoRecipe``
does this for an instance and for a factory that makes one (called with every mode set aside,
as bitsandbytes' factories are: what else it makes goes to the recipe bitsandbytes or torch
would use).

Note 2 (the compiled step). torchao's ``step`` calls ``torch.compile(single_param_adam,
fullgraph=True, dynamic=False)`` once per parameter: one graph per parameter shape and state
layout, its state subclasses (``OptimState4bit``, ...) desugared by AOTAutograd into their
codes and scales, and Inductor's generated code holding a few buffers where the eager step
holds every temporary (4 bits, a 4096 x 64 weight: two fp32 and two int64 buffers of the
parameter's size, against the eager step's dozen). ``CompiledStep`` runs the same loop and calls
``single_param_adam`` compiled the same way, into code whose buffers the trace counts
(``trace._counted_compile.counted_function``: Inductor's code for the CPU, its kernels no-ops). Where
Dynamo cannot compile a parameter's call, that parameter steps eagerly (``_torchao_optimizer``,
an upper bound) and ``step_note`` says so.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect

import torch
from torch._subclasses.fake_tensor import FakeTensor, is_fake
from torch.utils._python_dispatch import _disable_current_modes

from memfit.optimizers import OptimizerRecipe
from memfit.techniques._torchao_optimizer import (EagerStep, eager_class, is_torchao,
                                                   torchao_modules, unrolled_adam)
from memfit.trace._counted_compile import compiled_trace, counted_function
from memfit.trace.compiled import CPU_CODE_NOTE

__all__ = ["CompiledStep", "TorchaoRecipe", "rebuild_torchao", "may_make_torchao",
           "step_note", "STEPS"]

STEPS = ("compiled", "eager", "own")        # how a rebuilt optimizer steps (Note 1)


class CompiledStep(EagerStep):
    """torchao's step as torchao runs it, each parameter's update compiled (Note 2); on fake
    parameters only (a trace). ``eager_fallbacks``: the parameters' shapes Dynamo could not
    compile, stepped eagerly."""

    state_name = "low-bit"

    def _update(self, p, grad, state: dict, group: dict, stochastic_round: bool) -> None:
        if not is_fake(p):
            raise RuntimeError("CompiledStep steps fake parameters only (a trace); a real run "
                               "steps torchao's own class")
        fn = counted_function(torchao_modules()[1].single_param_adam, fullgraph=True)
        try:
            with compiled_trace():
                fn(p, grad, state["step"], state["exp_avg"], state["exp_avg_sq"],
                   state.get("max_exp_avg_sq"), group["lr"], *group["betas"],
                   group["weight_decay"], group["eps"], self.is_adamw, stochastic_round)
        except Exception as e:          # Dynamo, AOTAutograd or Inductor stopped (Note 2)
            if not _is_compile_error(e):
                raise
            self.__dict__.setdefault("eager_fallbacks", []).append(
                (tuple(p.shape), f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
                 if str(e).strip() else type(e).__name__))
            unrolled_adam(p, grad, state, group, self.is_adamw, stochastic_round)


def _is_compile_error(e: Exception) -> bool:
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor",
                                          "torch._functorch"))


@functools.cache
def compiled_class(cls: type) -> type:
    """``cls`` stepped as Note 2 says."""
    base = cls.__bases__[-1] if issubclass(cls, EagerStep) else cls
    return type(f"Compiled{base.__name__}", (CompiledStep, base), {})


def _float(value):
    """A real 0-d tensor (torchao's ``lr``) as a float, read outside every mode (Note 1)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        with _disable_current_modes():
            return value.item()
    return value


def rebuild_torchao(optimizer, new_of: dict[int, torch.Tensor], steps: str = "eager"):
    """A torchao ``optimizer`` over ``new_of[id(p)]``: its class, stepping as ``steps`` says
    (``STEPS``, Note 1), its groups, hyper-parameters, ``block_size`` and
    ``bf16_stochastic_round``. State is not copied."""
    if steps not in STEPS:
        raise ValueError(f"steps must be one of {', '.join(STEPS)}, got {steps!r}")
    torchao_modules()
    own = type(optimizer).__bases__[-1] if isinstance(optimizer, EagerStep) else type(optimizer)
    cls = {"compiled": compiled_class, "eager": eager_class, "own": lambda c: c}[steps](own)
    groups = [{**{k: _float(v) if k == "lr" else v for k, v in g.items()},
               "params": [new_of[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: _float(v) if k == "lr" else v for k, v in optimizer.defaults.items()
                if k in accepted}
    new = cls(groups, **defaults)
    new.block_size = optimizer.block_size
    new.bf16_stochastic_round = optimizer.bf16_stochastic_round
    return new


def _steps_for(optimizer, params) -> str:
    """An optimizer that steps eagerly (memfit's own classes, ``EagerStep``) steps so over new
    parameters too; torchao's own class is traced compiled (the parameters are fakes) and over
    real ones steps as itself (Note 1)."""
    if isinstance(optimizer, EagerStep) and not isinstance(optimizer, CompiledStep):
        return "eager"
    return "compiled" if any(is_fake(p) for p in params) else "own"


class TorchaoRecipe(OptimizerRecipe):
    """A user's torchao optimizer instance, or a factory that may make one (Note 1).
    ``other``: the recipe for what else a factory makes (bitsandbytes' or torch's)."""

    def __init__(self, spec, impl=None, other: OptimizerRecipe | None = None):
        super().__init__(spec, impl)
        self.other = other or OptimizerRecipe(spec, impl)

    def _made(self, params):
        with _disable_current_modes():
            return self.factory(params)

    def optimizer_class(self, params):
        if self.instance is not None:
            return type(self.instance)
        made = self._made(params)
        return type(made) if is_torchao(made) else self.other.optimizer_class(params)

    def build(self, params, origin):
        if self.instance is None:
            made = self._made(params)
            if not is_torchao(made):
                return self.other.build(params, origin)
            steps = _steps_for(made, params)
            return made if steps in ("own", "eager") else \
                rebuild_torchao(made, {id(p): p for p in params}, steps)
        if all(n is o for o, n in zip(origin, params)):
            return self.instance                # the user's own, over its own parameters
        return rebuild_torchao(self.instance, {id(o): n for o, n in zip(origin, params)},
                               _steps_for(self.instance, params))


def may_make_torchao(recipe: OptimizerRecipe) -> bool:
    """A user's factory, where torchao is installed: it may build one of its optimizers
    (``TorchaoRecipe`` finds out; torchao is not imported for this)."""
    return recipe.instance is None and not isinstance(recipe.spec, str) and _installed()


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def step_note(optimizer, device_kind: str) -> str | None:
    """The estimate's note on how a torchao optimizer's step was traced (None for any other)."""
    inner = getattr(optimizer, "inner", optimizer)
    name = type(inner).__name__
    if isinstance(inner, CompiledStep):
        words = [f"{name}: torchao's step traced compiled, as torchao runs it (each parameter's "
                 f"update one Inductor graph; its buffers as the generated code allocates them)"]
        if device_kind == "cuda":
            words.append(CPU_CODE_NOTE)
        failed = getattr(inner, "eager_fallbacks", [])
        if failed:
            shapes = sorted({s for s, _ in failed})
            words.append(f"torch.compile could not compile the update of {len(shapes)} "
                         f"parameter shape(s) ({failed[0][1]}): those stepped eagerly, an "
                         f"upper bound of their temporaries")
        return "; ".join(words)
    if isinstance(inner, EagerStep):
        return (f"{name}: torchao's step traced eagerly, as memfit runs it, each dequantize, "
                f"Adam update and quantize a separate op; torchao's own step compiles and "
                f"fuses them, so for a run of torchao's class the optimizer step's temporaries "
                f"here are an upper bound")
    return None
