"""torchao's low-bit Adam stepped eagerly: the classes ``low_bit_optimizer`` builds for
``optimizer_state="4bit"``/``"bf16"`` (in a trace and in ``fit``'s run alike), and a user's own
torchao optimizer where memfit steps it on the host (``optimizer_offload``). A user's own torchao
optimizer stepping as itself runs compiled, and is traced so (``_torchao_user``).

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
for each subclass). torchao's own (compiled) step fuses these ops and allocates less: for its
run, the eager step's temporaries are an upper bound. ``lr`` stays a float (torchao turns it into a tensor, which LR
schedulers then must ``fill_``); a tensor ``lr`` also works.

Note 2 (torchao's caches). torchao builds its quantization maps once per process
(``functools.lru_cache`` over ``tensor.tolist()``); built first under a fake trace they would
fail (a fake has no values), so ``torchao_modules`` builds them outside every mode, before any
state.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memfit.trace.per_parameter import once_per_kind

__all__ = ["EagerStep", "torchao_modules", "eager_class", "is_torchao", "unrolled_adam"]


def torchao_modules(what: str = "a torchao optimizer"):
    """(torchao.optim, adam, quant_utils, subclass_4bit, subclass_8bit, subclass_fp8), the maps
    built (Note 2); a ``ValueError`` with the fix where torchao is missing."""
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
    with _disable_current_modes():       # Note 2
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
                self._update(p.detach(), p.grad, state, group,
                             self.bf16_stochastic_round and p.dtype is torch.bfloat16)
        return loss

    @once_per_kind(lambda self, p, grad, state, group, sr: (p, grad, state, group, sr,
                                                           self.is_adamw))
    def _update(self, p, grad, state: dict, group: dict, stochastic_round: bool) -> None:
        """One parameter's update; in a trace of the optimizer phase, run once per kind of
        parameter (``trace.per_parameter``)."""
        unrolled_adam(p, grad, state, group, self.is_adamw, stochastic_round)

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


def unrolled_adam(p, grad, state, group, is_adamw: bool, stochastic_round: bool) -> None:
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
