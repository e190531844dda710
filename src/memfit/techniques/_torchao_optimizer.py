"""torchao's low-bit Adam as memfit steps it: the classes ``low_bit_optimizer`` builds for
``optimizer_state="4bit"``/``"bf16"``, and a user's own torchao optimizer (``AdamW8bit``,
``AdamW4bit``, ``AdamWFp8``, their Adam versions, ``_AdamW``; the HF Trainer's
``optim="adamw_torch_8bit"``/``"adamw_torch_4bit"``) rebuilt over other parameters.

Note 1 (the step: eager, every op at the top). torchao's ``step`` runs ``single_param_adam``
under ``torch.compile(fullgraph=True)``. That cannot be traced or measured: torch.compile
refuses to run under a (non-infra) ``TorchDispatchMode`` ("non-infra torch dispatch mode
present", and with ``fullgraph=True`` it raises), which is what ``memfit.track`` and the fake
trace are; and on CPU inductor builds C++ (gcc, about two minutes for a 2-layer MLP). Calling
torchao's function eagerly is no better for accounting: its state subclasses
(``OptimState4bit``, ``OptimState8bit``, ``OptimStateFp8``) quantize inside their
``__torch_dispatch__`` of ``copy_``, and a dispatch mode sees only that outer op, so a counter
would miss the quantization's temporaries (int64 codes, parameter-sized, per state). So
``EagerStep.step`` is torchao's ``single_param_adam`` (amsgrad included) with the subclass ops
unrolled: a state is loaded by the subclass's own Python ``dequantize()`` and stored by its
``copy_`` body (4 bits: ``scale_tensor``, ``quantize_4bit_with_qmap``, the packing of two
codes a byte; 8 bits: ``scale_tensor``, ``quantize_8bit_with_qmap``; fp8: ``quantize_fp8``),
all torchao functions called at the top, so every temporary is an op the counter sees, in the
estimate as in a real run. It is bitwise equal to torchao's eager step (tests hold it to that
for each subclass). The compiled step fuses these ops and allocates less, so for a user who
compiles (torchao always does) the step's temporaries are an upper bound
(``compiled_step_note``). ``lr`` stays a float (torchao turns it into a tensor, which LR
schedulers then must ``fill_``); a tensor ``lr`` also works.

Note 2 (a user's own torchao optimizer). A trace rebuilds the optimizer over fake parameters;
rebuilt as its class, its step would compile (Note 1). ``rebuild_torchao`` builds its class
with the ``EagerStep`` mixin over the new parameters: the same param groups and
hyper-parameters (a tensor ``lr``, torchao's, read as a float outside every mode: a real
tensor cannot meet a fake one), ``block_size`` and ``bf16_stochastic_round``, and torchao's own
``_new_buffer``, so its rule for which tensors are quantized (at least 4096 values, a multiple
of the block; the others keep moments in the parameter's dtype) is torchao's. Over the user's
own parameters (a real run) the user's instance steps as it is. ``TorchaoRecipe`` does this for
an instance and for a factory that makes one (called with every mode set aside, as
bitsandbytes' factories are: what else it makes goes to the recipe bitsandbytes or torch
would use).

Note 3 (torchao's caches). torchao builds its quantization maps once per process
(``functools.lru_cache`` over ``tensor.tolist()``); built first under a fake trace they would
fail (a fake has no values), so ``torchao_modules`` builds them outside every mode, before any
state.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memfit.optimizers import OptimizerRecipe

__all__ = ["EagerStep", "TorchaoRecipe", "torchao_modules", "eager_class", "is_torchao",
           "rebuild_torchao", "may_make_torchao", "compiled_step_note"]


def torchao_modules(what: str = "a torchao optimizer"):
    """(torchao.optim, adam, quant_utils, subclass_4bit, subclass_8bit, subclass_fp8), the maps
    built (Note 3); a ``ValueError`` with the fix where torchao is missing."""
    try:
        import torchao.optim as ao
        from torchao.optim import adam, quant_utils, subclass_4bit, subclass_8bit, subclass_fp8
    except ImportError as e:
        raise ValueError(f"{what} needs torchao (>= 0.18), which is not installed: pip install "
                         "torchao") from e
    _build_maps(subclass_4bit, subclass_8bit)
    return ao, adam, quant_utils, subclass_4bit, subclass_8bit, subclass_fp8


@functools.cache
def _build_maps(*subclass_modules) -> None:
    with _disable_current_modes():       # Note 3
        for sub in subclass_modules:
            sub.get_qmap_signed()
            sub.get_qmap_unsigned()


class EagerStep:
    """torchao's step, eager and unrolled (Note 1); mixed in before a torchao class."""

    state_name = "low-bit"

    def add_param_group(self, param_group: dict) -> None:
        torch.optim.Optimizer.add_param_group(self, param_group)    # lr stays a float (Note 1)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("low-bit Adam does not support sparse gradients")
                state = self._state_of(p, group)
                state["step"] += 1
                _adam(p.detach(), p.grad, state, group, self.is_adamw,
                      self.bf16_stochastic_round and p.dtype is torch.bfloat16)
        return loss

    @torch.no_grad()
    def first_step_state(self) -> None:
        """The state of each parameter with a gradient, as its first ``step`` makes it, without
        the update (a trace's warm-up needs the state, not the step's ops:
        ``trace.profile.warm_up_optimizer``)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._state_of(p, group)

    def _state_of(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(p, True)
            state["exp_avg_sq"] = self._new_buffer(p, False)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = self._new_buffer(p, False)
        return state


def _load(x: torch.Tensor) -> torch.Tensor:
    """A state as fp32: a subclass's own ``dequantize()`` (top-level ops), else ``.float()``."""
    _, _, _, s4, s8, f8 = torchao_modules()
    if isinstance(x, (s4.OptimState4bit, s8.OptimState8bit, f8.OptimStateFp8)):
        return x.dequantize()
    return x.float()


def _store(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, with torchao's subclass ``copy_`` body unrolled (Note 1)."""
    _, _, q, s4, s8, f8 = torchao_modules()
    if isinstance(dst, s4.OptimState4bit):
        scaled, scale = q.scale_tensor(src.view(-1), dst.block_size)
        codes = q.quantize_4bit_with_qmap(scaled, dst.qmap)
        dst.codes.copy_((codes[::2] << 4) | codes[1::2])
    elif isinstance(dst, s8.OptimState8bit):
        scaled, scale = q.scale_tensor(src, dst.block_size)
        dst.codes.copy_(q.quantize_8bit_with_qmap(scaled, dst.qmap))
    elif isinstance(dst, f8.OptimStateFp8):
        codes, scale = f8.quantize_fp8(src, dst.block_size)
        dst.codes.copy_(codes)
    else:
        dst.copy_(src)
        return
    dst.scale.copy_(scale)


def _adam(p, grad, state, group, is_adamw: bool, stochastic_round: bool) -> None:
    """torchao's ``single_param_adam`` (0.18), op for op (Note 1)."""
    lr, (beta1, beta2) = group["lr"], group["betas"]
    weight_decay, eps, step = group["weight_decay"], group["eps"], state["step"]
    p_f32 = p.float()
    grad_f32 = grad.float()
    if is_adamw:
        p_f32 = p_f32 - lr * weight_decay * p_f32
    else:
        grad_f32 = grad_f32 + weight_decay * p_f32
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    exp_avg_f32 = _load(state["exp_avg"]).lerp(grad_f32, 1 - beta1)
    exp_avg_sq_f32 = _load(state["exp_avg_sq"]).lerp(grad_f32.square(), 1 - beta2)
    _store(state["exp_avg"], exp_avg_f32)
    _store(state["exp_avg_sq"], exp_avg_sq_f32)
    if "max_exp_avg_sq" in state:
        max_f32 = torch.maximum(_load(state["max_exp_avg_sq"]), exp_avg_sq_f32)
        _store(state["max_exp_avg_sq"], max_f32)
        denom = (max_f32.sqrt() / bias_correction2.sqrt()) + eps
    else:
        denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom
    if stochastic_round:
        p.copy_(torchao_modules()[2]._fp32_to_bf16_sr(p_f32))
    else:
        p.copy_(p_f32)


def is_torchao(optimizer) -> bool:
    """A torchao low-bit Adam (its ``_AdamBase``; torchao is not imported for this)."""
    mod = sys.modules.get("torchao.optim.adam")
    return mod is not None and isinstance(optimizer, mod._AdamBase)


@functools.cache
def eager_class(cls: type) -> type:
    """``cls`` stepped as Note 1 says (itself when it already is)."""
    return cls if issubclass(cls, EagerStep) else type(f"Eager{cls.__name__}", (EagerStep, cls), {})


def _float(value):
    """A real 0-d tensor (torchao's ``lr``) as a float, read outside every mode (Note 2)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        with _disable_current_modes():
            return value.item()
    return value


def rebuild_torchao(optimizer, new_of: dict[int, torch.Tensor]):
    """A torchao ``optimizer`` over ``new_of[id(p)]``: its class stepped eagerly, its groups,
    hyper-parameters, ``block_size`` and ``bf16_stochastic_round`` (Note 2). State is not
    copied."""
    torchao_modules()
    cls = eager_class(type(optimizer))
    groups = [{**{k: _float(v) if k == "lr" else v for k, v in g.items()},
               "params": [new_of[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: _float(v) if k == "lr" else v for k, v in optimizer.defaults.items()
                if k in accepted}
    new = cls(groups, **defaults)
    new.block_size = optimizer.block_size
    new.bf16_stochastic_round = optimizer.bf16_stochastic_round
    return new


class TorchaoRecipe(OptimizerRecipe):
    """A user's torchao optimizer instance, or a factory that may make one (Note 2).
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
        return eager_class(type(made)) if is_torchao(made) else self.other.optimizer_class(params)

    def build(self, params, origin):
        if self.instance is None:
            made = self._made(params)
            if is_torchao(made):
                return rebuild_torchao(made, {id(p): p for p in params})
            return self.other.build(params, origin)
        if all(n is o for o, n in zip(origin, params)):
            return self.instance                # the user's own, over its own parameters
        return rebuild_torchao(self.instance, {id(o): n for o, n in zip(origin, params)})


def may_make_torchao(recipe: OptimizerRecipe) -> bool:
    """A user's factory, where torchao is installed: it may build one of its optimizers
    (``TorchaoRecipe`` finds out; torchao is not imported for this)."""
    return recipe.instance is None and not isinstance(recipe.spec, str) and _installed()


@functools.cache
def _installed() -> bool:
    return importlib.util.find_spec("torchao") is not None


def compiled_step_note(optimizer) -> str | None:
    """The estimate's note for an optimizer stepped as Note 1 says (None for any other)."""
    inner = getattr(optimizer, "inner", optimizer)
    if not isinstance(inner, EagerStep):
        return None
    return (f"{type(inner).__name__}: torchao's step was traced eagerly, each dequantize, "
            "Adam update and quantize a separate op; torch.compile (which torchao's own step "
            "runs) fuses them, so the optimizer step's temporaries here are an upper bound for "
            "a compiled run")
