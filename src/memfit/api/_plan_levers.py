"""The planner's levers beyond the per-block modes, weighed once the plain step does not fit:
low-bit optimizer states where the numerics may change, the loss in pieces (a causal LM's chunked
cross-entropy), the optimizer stepped in backward, and the gradients then the block weights on
the host, each modelled on demand, once. And the last levers (``last_levers``), with which the
whole plan is made again when nothing fits: a compiled model's ``activation_memory_budget``,
else a LoRA job's base held in NF4 (QLoRA).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from memfit.api._floor import first_samples
from memfit.api._plan_deferred import LowBitStates, traced_states
from memfit.api.estimate import estimate
from memfit.knobs import Knobs
from memfit.measure._compile_aware import has_compiled
from memfit.planner.variants import (GRAD_OFFLOAD_PRECISIONS, IN_BACKWARD_PRECISIONS,
                                     add_chunked_loss, add_gradient_offload,
                                     add_optimizer_in_backward, add_param_offload)
from memfit.techniques.chunked_loss import chunkable
from memfit.techniques.quantized_base import QuantizedBase

__all__ = ["Levers", "numerics_allowed", "state_knobs", "in_backward_open",
           "grads_offload_open", "LastLever", "last_levers", "QLORA", "COMPILE_BUDGETS"]

QLORA = "nf4"                    # the base's quantization the planner weighs (QLoRA's)
COMPILE_BUDGETS = (0.75, 0.5, 0.25, 0.0)     # activation_memory_budget values weighed, in turn


@dataclass(frozen=True)
class LastLever:
    """A knob the whole plan is made again with, once nothing fits without it; ``weighed``:
    also where a plan fits but slows the step, the faster of the two taken (``faster``)."""

    knob: str
    value: object
    progress: str          # what the planner says as it plans again
    why: str               # the plan's first reason, when it fits
    weighed: bool = False
    faster: str = ""       # the first reason when weighed and faster ({other}: the plan beaten)
    progress_weighed: str = ""     # what the planner says as it weighs it


def last_levers(model, k: Knobs, allow_numerics_change: bool | None) -> list[LastLever]:
    """The levers to plan again with, in turn, the first plan that fits the answer (none: the
    refusal stands). A compiled model whose caller left ``activation_memory_budget`` unset:
    each of ``COMPILE_BUDGETS`` (torch.compile's own lever; per-block modes do not apply
    inside a compiled region; the numerics stay), weighed also against a plan that fits by
    slowing the step. Else, where the numerics may change and the
    caller left ``quantize_base`` unset, a model with a frozen float linear layer (a LoRA job):
    its base in NF4."""
    if k.activation_memory_budget is None and has_compiled(model):
        return [LastLever(
            "activation_memory_budget", value,
            "nothing fits as torch.compile partitions by default: planning again with "
            f"activation_memory_budget={value}",
            f"activation_memory_budget={value}: nothing fits with torch.compile's default "
            f"partition (every activation the min-cut partitioner likes kept), so it keeps "
            f"{value:.0%} of them and recomputes the rest in backward (set in "
            f"torch._functorch.config while the model compiles; the numerics do not change)",
            weighed=True,
            progress_weighed=f"weighing activation_memory_budget={value} against the plan "
                             "found (it slows the step)",
            faster=f"activation_memory_budget={value}: the min-cut partitioner keeps "
                   f"{value:.0%} of the activations and recomputes the rest in backward, "
                   f"predicted faster than the fastest plan at its default partition "
                   "({other}); set in torch._functorch.config while the model compiles; the "
                   "numerics do not change")
            for value in COMPILE_BUDGETS]
    if _weighs_qlora(model, k, allow_numerics_change):
        return [LastLever(
            "quantize_base", QLORA,
            f"nothing fits with the frozen base in float: planning again with it in "
            f"{QLORA.upper()} (QLoRA)",
            f"QLoRA: nothing fits with the frozen base weights in float, so they are held in "
            f"{QLORA.upper()} by bitsandbytes (double quantization, bf16 compute; quantized in "
            "place when the plan runs). This changes the numerics (allowed)")]
    return []


def _weighs_qlora(model, k: Knobs, allow_numerics_change) -> bool:
    """Quantizing the base is weighed: numerics may change, the caller left ``quantize_base``
    unset, and the model has a frozen float linear layer (a LoRA job)."""
    if not numerics_allowed(allow_numerics_change, k) or k.quantize_base is not None or \
            k.remat:
        return False
    try:
        return QuantizedBase(QuantizedBase.Config(kind=QLORA)).pending(model) and \
            importlib.util.find_spec("bitsandbytes") is not None
    except ValueError:
        return False


def numerics_allowed(allow: bool | None, k: Knobs) -> bool:
    """Whether levers that change the numerics (low-bit optimizer states) may be weighed:
    as the caller says, else under precision "auto" only (the API's default keeps them)."""
    if allow is not None and not isinstance(allow, bool):
        raise ValueError(f"allow_numerics_change must be True, False or None, got {allow!r}")
    return allow if allow is not None else k.precision == "auto"


def state_knobs(k: Knobs) -> dict:
    """The caller's fixed optimizer_state / offload_params / chunked_loss /
    optimizer_in_backward / activation_memory_budget, for every trace (parameter offload needs
    the optimizer state on the host)."""
    out = _fixed_levers(k)
    if k.optimizer_state is not None:
        out["optimizer_state"] = k.optimizer_state
    if k.offload_params not in (None, "none"):
        out["offload_params"] = k.offload_params
        out["offload_optimizer"] = True if k.offload_optimizer is None else k.offload_optimizer
    if k.offload_gradients:          # it needs the optimizer state on the host too
        out["offload_gradients"] = True
        out["offload_optimizer"] = True if k.offload_optimizer is None else k.offload_optimizer
    return out


def grads_offload_open(k: Knobs, user_step: bool) -> bool:
    """Whether the search may move the gradients to the host in backward: the caller left it
    unset and fixed nothing it refuses (the state on the device, the block weights on the host,
    the optimizer in backward, a user step: techniques.optimizer_offload)."""
    return k.offload_gradients is None and not user_step and k.offload_optimizer is not False \
        and k.offload_params in (None, "none") and not k.optimizer_in_backward


def in_backward_open(k: Knobs, user_step: bool, b: int) -> bool:
    """Whether the search may step the optimizer in backward: the caller left it unset and
    fixed nothing it refuses (accumulation, clipping, a keep-buffers loop, the state or weights
    on the host, a user step: docs/techniques/optimizer-in-backward.md)."""
    return k.optimizer_in_backward is None and not user_step and k.max_grad_norm is None and \
        k.zero_grad != "keep-buffers" and k.micro_batch_size in (None, b) and \
        not k.offload_gradients and \
        not k.offload_optimizer and k.offload_params in (None, "none")


def _fixed_levers(k: Knobs) -> dict:
    """The levers the caller switched on that every lever's trace keeps too."""
    out = {"chunked_loss": k.chunked_loss} if k.chunked_loss else {}
    if k.optimizer_in_backward:
        out["optimizer_in_backward"] = True
    if k.activation_memory_budget is not None:     # a compiled model's partition (docs/compiled.md)
        out["activation_memory_budget"] = k.activation_memory_budget
    return out


class Levers:
    """Adds the planner's lever models on demand, once each: low-bit states only where the
    numerics may change (Adam/AdamW, the library installed), the chunked loss where the step's
    loss is a causal LM's own, the optimizer in backward where nothing fixed needs every
    gradient after backward, parameter offload as a last resort. A chunked_loss or
    optimizer_in_backward the caller fixed is in every trace."""

    def __init__(self, model, batch, models, traces, common, spec, b, k: Knobs,
                 numerics: bool, user_step: bool, say, optimizer_class: Callable[[], type]):
        self.models, self.traces, self.spec, self.b, self.say = models, traces, spec, b, say
        self.k, self.numerics, self.user_step = k, numerics, user_step
        self._optimizer_class = optimizer_class
        self._done: set[str] = set()
        self._chunkable = common.get("loss_fn") is None and not user_step and \
            not has_compiled(model) and chunkable(model)       # refused for a compiled model
        fixed = _fixed_levers(k)

        def trace(precision, samples, **knobs):
            part = batch if samples is None else first_samples(batch, samples)
            return estimate(model, part, precision=precision, allocator_replay=False,
                            **{**fixed, **knobs}, **common)
        self.trace = trace
        self.states = LowBitStates(models, traces, trace, say,    # api._plan_deferred
                                   sum(p.numel() for p in model.parameters() if p.requires_grad))

    def traces_ahead(self, precisions: list[str]) -> int:
        """The traces ``add_low_bit``, ``add_chunked_loss`` and ``add_optimizer_in_backward``
        expect to run where ``precisions`` are traced (an ETA's count: a state whose library
        is missing traces nothing)."""
        in_backward = in_backward_open(self.k, self.user_step, self.b) and \
            any(q in IN_BACKWARD_PRECISIONS for q in precisions)
        return len(traced_states()) * self._low_bit_open() + 2 * self._chunked_open() + \
            in_backward                                  # the other states bounded first

    def _low_bit_open(self) -> bool:
        k = self.k
        return self.numerics and k.optimizer_state is None and k.optimizer_impl is None and \
            not self.user_step and k.offload_params in (None, "none")

    def _chunked_open(self) -> bool:
        return self.k.chunked_loss is None and self._chunkable

    def add_low_bit(self) -> None:
        if "low_bit" in self._done:
            return
        self._done.add("low_bit")
        if self._low_bit_open():
            self.states.add(self._optimizer_class())

    def add_chunked_loss(self) -> None:
        """The loss in pieces beside the plain model the search prefers (the precision auto
        prefers, the optimizer as given), unless the caller fixed chunked_loss."""
        if "chunked" in self._done:
            return
        self._done.add("chunked")
        if self._chunked_open():
            first = next(iter(self.traces))         # the precision auto prefers
            add_chunked_loss(self.models, self.trace, self.spec, self.b, self.say,
                             (first, self.k.optimizer_impl))

    def add_optimizer_in_backward(self) -> None:
        """The optimizer in backward beside the plain model of the first precision it runs
        with (fp32 or bf16), where ``in_backward_open``."""
        k = self.k
        if "in_backward" in self._done or not in_backward_open(k, self.user_step, self.b):
            return
        first = next((q for q in self.traces if q in IN_BACKWARD_PRECISIONS), None)
        if first is not None:        # else again once a precision it runs with is traced
            self._done.add("in_backward")
            add_optimizer_in_backward(self.models, self.trace, self.spec, self.b, self.say,
                                      (first, k.optimizer_impl))

    def add_gradient_offload(self) -> bool:
        """The gradients moved to the host in backward beside the plain model the search
        prefers, weighed when nothing else fits (planner.variants). Whether models were added
        now (False: done before, or not allowed)."""
        if "grads" in self._done:
            return False
        self._done.add("grads")
        if not grads_offload_open(self.k, self.user_step):
            return False
        first = next((q for q in self.traces if q in GRAD_OFFLOAD_PRECISIONS), None)
        return first is not None and add_gradient_offload(
            self.models, self.trace, self.spec, self.b, self.say, (first, self.k.optimizer_impl))

    def add_param_offload(self) -> bool:
        """Whether models were added now (False: done before, or not allowed)."""
        k = self.k
        if "params" in self._done:
            return False
        self._done.add("params")
        if k.offload_params is not None or k.offload_optimizer is False or self.user_step:
            return False
        first = next(iter(self.traces))         # the precision auto prefers
        return add_param_offload(self.models, self.traces, self.trace, self.spec, self.b,
                                 self.say, precisions=[first])
