"""The canonical training step and the user's own, shared by real runs and fake traces.

One code path for both is what makes ``estimate`` equal ``track`` to the byte: the fake trace
runs exactly this function on fake copies of the model, batch and optimizer.

Note 1 (zero_grad placement). ``zero_grad`` (``memfit.Knobs``) says where the canonical step
frees or zeroes the previous step's gradients: "before-forward" (``zero_grad(set_to_none=True)``
first, DESIGN's canonical step), "after-forward" (the same call between forward and backward:
last step's gradients are alive through the forward) or "keep-buffers"
(``zero_grad(set_to_none=False)`` first: the buffers are zeroed in place and never freed).

Note 2 (the user's step). ``UserStep`` wraps ``fn(model, batch, optimizer)`` and calls it as
written: nothing in it is rewritten, so what reaches it from memfit comes only through the
model (block hooks: recompute, offload) and the optimizer (offloaded state, another
implementation). It marks the phases the planner reads: "forward" when the call starts and
"optimizer" when ``optimizer.step`` is first entered (an optimizer step pre-hook, removed after
the call); "backward" is read off the trace afterwards (``api._user_step``). Whatever ``fn``
keeps between calls (an EMA copy, a scheduler, a GradScaler) must be made from the arguments it
receives, e.g. in a ``weakref.WeakKeyDictionary`` keyed on the model or the optimizer: a trace
calls it on fake copies, several times.

Note 3 (CUDA autocast without CUDA). On a build or machine without CUDA, entering
``torch.autocast("cuda")`` warns "CUDA is not available ... Disabling autocast" and runs the
region uncast. A real run on that machine does the same, but a trace made here *for a GPU*
would count an fp32 step where the GPU runs a 16-bit one. ``UserStep`` notes that the warning
came (``cuda_autocast_off``), passing every warning on unchanged, so that an estimate for a GPU
can refuse instead of answering for another step (``api._user_step.check_cuda_autocast``).
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["prepare_batch", "compute_loss", "canonical_step", "zero_grad", "UserStep",
           "check_steppable"]

_MASK_KEYS = ("attention_mask", "decoder_attention_mask")
_SHOWN: dict = {}            # warnings passed on, shown once per place (Note 3)
_CUDA_AUTOCAST_OFF = "CUDA is not available or torch_xla is imported. Disabling autocast"


def prepare_batch(batch, compiled: bool = False):
    """Drop an all-ones attention mask from a Mapping batch (a copy; the input is untouched).

    An all-ones mask means "no mask". transformers skips building the 4-D mask for it on real
    tensors but cannot tell under a fake trace, so keeping it would make the trace take another
    branch (and other memory) than the real step. Masks on the ``meta`` device or already fake
    cannot be read and are kept. So is every mask of a ``compiled`` model: under
    ``torch.compile`` transformers cannot read the mask either and builds the 4-D mask, so the
    real compiled step holds it.
    """
    if not isinstance(batch, Mapping) or compiled:
        return batch
    out = dict(batch)
    for key in _MASK_KEYS:
        mask = out.get(key)
        if (isinstance(mask, torch.Tensor) and mask.device.type != "meta"
                and not isinstance(mask, torch._subclasses.FakeTensor) and bool((mask == 1).all())):
            del out[key]
    return out


def compute_loss(model: nn.Module, batch, loss_fn: Callable | None = None) -> torch.Tensor:
    """``loss_fn(model, batch)``, or for a Mapping batch ``model(**batch).loss``."""
    if loss_fn is not None:
        loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return the loss as a one-element tensor, got "
                             f"{type(loss).__name__}" + (f" of shape {tuple(loss.shape)}"
                                                         if isinstance(loss, torch.Tensor) else ""))
        return loss
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"the batch is a {type(batch).__name__}, not a mapping of model inputs: pass "
            "loss_fn(model, batch) -> loss to say how to compute the loss"
        )
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"{type(model).__name__}(**batch) returned no loss: include labels in the batch "
            f"(keys now: {sorted(batch)}), or pass loss_fn(model, batch) -> loss"
        )
    return loss


def zero_grad(optimizer, style: str | None, where: str) -> None:
    """``optimizer.zero_grad`` as loop ``style`` places it (Note 1); ``where`` is "start" or
    "after-forward", the two places a step may call it."""
    style = style or "before-forward"
    if style == "after-forward":
        if where == "after-forward":
            optimizer.zero_grad(set_to_none=True)
    elif where == "start":
        optimizer.zero_grad(set_to_none=style == "before-forward")


def canonical_step(model: nn.Module, optimizer, batch, loss_fn: Callable | None = None,
                   autocast: contextlib.AbstractContextManager | None = None,
                   on_phase: Callable[[str], None] | None = None,
                   zero_grad_style: str | None = None) -> torch.Tensor:
    """zero_grad(set_to_none) -> forward -> loss -> backward -> optimizer.step; returns the loss.

    ``on_phase`` is called with "forward", "backward" and "optimizer" as each phase starts.
    ``zero_grad_style`` moves or changes the zero_grad (Note 1; default "before-forward").
    """
    mark = on_phase or (lambda phase: None)
    check_steppable(optimizer)
    zero_grad(optimizer, zero_grad_style, "start")
    mark("forward")
    with autocast if autocast is not None else contextlib.nullcontext():
        loss = compute_loss(model, batch, loss_fn)
    zero_grad(optimizer, zero_grad_style, "after-forward")
    mark("backward")
    loss.backward()
    loss = loss.detach()
    mark("optimizer")
    optimizer.step()
    return loss


def check_steppable(optimizer) -> None:
    """An optimizer memfit cannot step or trace: a ``ValueError`` naming the fix. SparseAdam
    steps sparse gradients only, which a trace's warm-up (dense zeros, trace.profile) and every
    lever of memfit's (accumulation buffers, offload copies) do not keep sparse; a ``step``
    needing a closure (LBFGS) re-runs the step on the loss's value."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError("SparseAdam (sparse gradients of nn.Embedding(sparse=True)) is not "
                         "supported: memfit traces and steps dense gradients; use Adam or AdamW")
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{type(optimizer).__name__}.step needs a closure (optimizer.step(closure) re-runs "
            "the forward and backward as often as it likes, reading the loss's value each "
            "time), which memfit can neither run in its standard step nor trace: use a "
            "first-order optimizer (AdamW, Adam, SGD, Adafactor)")


class UserStep:
    """The user's training step ``fn(model, batch, optimizer)``, called as written (Note 2).

    Calling it returns what ``fn`` returned: None, or the loss (a one-element tensor or a
    number); anything else is refused with the fix."""

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise ValueError(f"step must be a function fn(model, batch, optimizer), got "
                             f"{type(fn).__name__}")
        try:
            inspect.signature(fn).bind(None, None, None)
        except TypeError as e:
            raise ValueError(f"step={getattr(fn, '__name__', fn)!r} cannot be called as "
                             f"fn(model, batch, optimizer): {e}; give it exactly those three "
                             "positional parameters (keep other state in a closure)") from None
        except ValueError:          # no signature to read (a builtin): let the call decide
            pass
        self.fn = fn
        self.name = getattr(fn, "__qualname__", type(fn).__name__)
        self.cuda_autocast_off = False    # Note 3: it entered torch.autocast("cuda") without CUDA

    def __call__(self, model: nn.Module, batch, optimizer,
                 on_phase: Callable[[str], None] | None = None):
        mark = on_phase or (lambda phase: None)

        def optimizer_starts(*args) -> None:      # a pre-hook's None keeps step's arguments
            mark("optimizer")

        handle = None
        if hasattr(optimizer, "register_step_pre_hook"):
            handle = optimizer.register_step_pre_hook(optimizer_starts)
        caught = []
        try:
            mark("forward")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = self.fn(model, batch, optimizer)
        finally:
            if handle is not None:
                handle.remove()
            for w in caught:                  # Note 3: seen, then passed on as they came
                if _CUDA_AUTOCAST_OFF in str(w.message):
                    self.cuda_autocast_off = True
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                       registry=_SHOWN)
        return self.check_result(out)

    def check_result(self, out):
        if out is None or isinstance(out, numbers.Real) and not isinstance(out, bool):
            return out
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            return out          # as is: a detach would be one more op than the real step runs
        what = type(out).__name__
        if isinstance(out, torch.Tensor):
            what = f"a tensor of shape {tuple(out.shape)}"
        raise ValueError(f"step {self.name} returned {what}: return the loss (a one-element "
                         "tensor or a number), or None")
