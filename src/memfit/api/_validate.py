"""Checks on a (model, batch) pair that a fake trace cannot make: they need real values."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from memfit.optimizers import OPTIMIZERS
from memfit.techniques.accumulation import unwrap
from memfit.units import parse_bytes
from memfit.zoo._batches import table_limit
from memfit.zoo._model_arg import check_model

__all__ = ["check_model", "check_batch", "check_micro_batch", "describe_batch_mismatch",
           "check_order"]

# the three fronts' positional orders, named in the error (issue 26): they differ
_ORDERS = {"estimate": "memfit.estimate(model, batch, optimizer, device, loss_fn)",
           "plan": "memfit.plan(model, batch, budget, optimizer, device, loss_fn)",
           "fit": "memfit.fit(model, optimizer, batch, budget, device, loss_fn)"}


def check_micro_batch(micro_batch_size: int | None, batch_size: int) -> None:
    """A micro-batch larger than the batch it splits: refused (it would silently be the whole
    batch, and the figure the one of a step not asked for)."""
    if micro_batch_size is not None and micro_batch_size > batch_size:
        raise ValueError(f"micro_batch_size={micro_batch_size} is larger than the batch "
                         f"({batch_size} samples): give at most {batch_size} (the whole batch "
                         "in one micro-batch), or a larger batch")


def check_batch(model: nn.Module, batch, loss_fn=None) -> None:
    """Raise ``ValueError`` naming the fix when ``batch`` cannot be fed to ``model``.
    (With a ``loss_fn`` the batch is the user's to interpret: only sizes are checked.)"""
    if not isinstance(batch, Mapping):
        return
    model = unwrap(model)
    config = getattr(model, "config", None)
    ids = batch.get("input_ids")
    if config is not None and isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        limit, why = table_limit(config)
        if limit is not None and ids.shape[-1] > limit:
            raise ValueError(
                f"the batch's sequence length {ids.shape[-1]} exceeds what "
                f"{type(model).__name__} can embed ({limit} positions: {why}): give a batch whose "
                f"input_ids hold at most {limit} tokens per row"
            )
        vocab = getattr(config, "vocab_size", None)
        if vocab and ids.device.type != "meta" and not isinstance(ids, torch._subclasses.FakeTensor):
            top = int(ids.max()) if ids.numel() else 0
            if top >= vocab:
                raise ValueError(f"the batch holds token id {top} but the model's vocabulary has "
                                 f"{vocab} entries: make the batch with this model's tokenizer")
    if loss_fn is not None:
        return
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    named = _named(sig)
    if not named:       # forward(*args, **kwargs): a wrapper passes all on
        return
    get_base = getattr(model, "get_base_model", None)    # peft's PeftModel passes the rest on
    base = get_base() if callable(get_base) else None
    if isinstance(base, nn.Module) and base is not model:
        try:
            named |= _named(inspect.signature(base.forward))
        except (TypeError, ValueError):
            return
    # A tensor the forward does not name would vanish into **kwargs (transformers accepts
    # and ignores them): almost always a batch made for another model.
    extra = sorted(k for k, v in batch.items() if k not in named and isinstance(v, torch.Tensor))
    if extra:
        raise ValueError(
            f"{type(model).__name__}.forward takes no input(s) {', '.join(extra)} (batch keys: "
            f"{sorted(batch)}); its inputs are: {', '.join(sorted(named))}"
        )


def _named(sig: inspect.Signature) -> set[str]:
    """The parameters a forward names (not its ``*args`` or ``**kwargs``)."""
    return {n for n, p in sig.parameters.items()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def describe_batch_mismatch(model: nn.Module, batch, error: Exception) -> ValueError:
    """A ValueError for a shape error raised while running ``model(**batch)``."""
    shapes = {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)} \
        if isinstance(batch, Mapping) else type(batch).__name__
    return ValueError(
        f"the batch does not match {type(model).__name__}: {error} (batch: {shapes}). Make the "
        "batch for this model (memfit.zoo specs have make_batch) or check its sizes"
    )


def _looks_like_budget(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        parse_bytes(value)
    except ValueError:
        return False
    return True


def _looks_like_optimizer(value) -> bool:
    return isinstance(value, torch.optim.Optimizer) or callable(value) and \
        not isinstance(value, nn.Module) or isinstance(value, str) and value in OPTIMIZERS


def check_order(front: str, *, optimizer=None, budget=None, batch=None) -> None:
    """A value given in another front's position (the orders differ): a ``ValueError`` naming
    this front's order and the keyword to use, not an error about the value."""
    wrong = None
    if front == "plan" and budget is not None and _looks_like_optimizer(budget):
        wrong = f"the third argument is the budget, and {_short(budget)} is an optimizer " \
                "(or a function), not a byte size: pass optimizer=... (or loss_fn=...) by keyword"
    elif front == "estimate" and _looks_like_budget(optimizer):
        wrong = f"the third argument is the optimizer, and {optimizer!r} is a byte size: " \
                f"pass budget={optimizer!r} by keyword"
    elif front == "fit" and isinstance(optimizer, (Mapping, torch.Tensor)) and \
            _looks_like_optimizer(batch):
        wrong = "the optimizer comes second and the batch third: fit(model, optimizer, batch)"
    if wrong:
        raise ValueError(f"{_ORDERS[front]}: {wrong} (estimate, plan and fit take their "
                         "arguments after the model in different orders: name them by keyword)")


def _short(value) -> str:
    return repr(value) if isinstance(value, str) else type(value).__name__
