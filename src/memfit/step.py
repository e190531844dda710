"""The canonical training step, shared by real runs and fake traces.

One code path for both is what makes ``estimate`` equal ``track`` to the byte: the fake trace
runs exactly this function on fake copies of the model, batch and optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["prepare_batch", "compute_loss", "canonical_step"]

_MASK_KEYS = ("attention_mask", "decoder_attention_mask")


def prepare_batch(batch):
    """Drop an all-ones attention mask from a Mapping batch (a copy; the input is untouched).

    An all-ones mask means "no mask". transformers skips building the 4-D mask for it on real
    tensors but cannot tell under a fake trace, so keeping it would make the trace take another
    branch (and other memory) than the real step. Masks on the ``meta`` device or already fake
    cannot be read and are kept.
    """
    if not isinstance(batch, Mapping):
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


def canonical_step(model: nn.Module, optimizer, batch, loss_fn: Callable | None = None,
                   autocast: contextlib.AbstractContextManager | None = None,
                   on_phase: Callable[[str], None] | None = None) -> torch.Tensor:
    """zero_grad(set_to_none) -> forward -> loss -> backward -> optimizer.step; returns the loss.

    ``on_phase`` is called with "forward", "backward" and "optimizer" as each phase starts.
    """
    mark = on_phase or (lambda phase: None)
    optimizer.zero_grad(set_to_none=True)
    mark("forward")
    with autocast if autocast is not None else contextlib.nullcontext():
        loss = compute_loss(model, batch, loss_fn)
    mark("backward")
    loss.backward()
    loss = loss.detach()
    mark("optimizer")
    optimizer.step()
    return loss
