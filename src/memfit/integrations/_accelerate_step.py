"""One optimizer step of an Accelerate training loop as a memfit user step (``step=fn``).

Note 1 (the loop). An Accelerate user writes, for every batch of the dataloader::

    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)            # loss / gradient_accumulation_steps
        if accelerator.sync_gradients and max_grad_norm:    # when asked
            accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()                      # accelerate's wrapper: only when syncing
        optimizer.zero_grad()                 # idem, set_to_none=True

One optimizer step is ``gradient_accumulation_steps`` such bodies: ``accumulate`` counts them
(``accelerator.step``) and sets ``sync_gradients`` on the last, and the prepared optimizer
(``AcceleratedOptimizer``) steps and zeroes only then. ``AccelerateStep`` runs exactly that
body (or the user's own ``body(model, batch, optimizer)``) over the micro-batches of the traced
batch, with the accelerator's own ``accumulate``, ``backward`` and ``clip_grad_norm_``, and the
fake optimizer memfit passes in wrapped in accelerate's own ``AcceleratedOptimizer``. What the
body returns (the loop's ``loss`` variable) stays alive until the next body's forward has
replaced it, across optimizer steps too, as in the real loop.

Note 2 (mixed precision). ``accelerator.prepare(model)`` wraps the model's ``forward`` in
autocast with fp32 outputs (``mixed_precision="bf16"``; on CPU accelerate turns fp16 off). A
prepared model's fake copy carries that wrapper (a deep copy rebinds it); an unprepared one is
prepared on its first call through accelerate's own ``prepare_model`` (no device placement; the
copy is taken off the accelerator's model list again). A GradScaler (fp16 on a GPU) is refused:
the accelerator's scaler is a real one over the real optimizer.

Note 3 (the accelerator's loop state). ``accumulate`` advances ``accelerator.step`` and sets
``sync_gradients`` (on every batch at the end of a prepared dataloader: ``end_of_dataloader``);
``step_state`` starts the trace at an optimizer-step boundary (``step`` 0) in the middle of an
epoch (no active dataloader, e.g. one a loop broke out of) and puts all three back afterwards,
so a real loop resumes where it was.

Note 4 (the batch). ``traced_batch`` gives ``{MICRO: [...]}``, the
``gradient_accumulation_steps`` micro-batches of one step: the ones given (a list, all alive for
the whole step, as a list of batches is in a real loop), or one Mapping used for each (a loop
over one cached batch). From a DataLoader its first batch is used for each micro-batch (the
shapes it repeats); a prepared one (accelerate's ``DataLoaderShard``) reads one batch ahead to
know where the epoch ends, so two batches are alive during every step but the last of an
epoch: ``AHEAD``, a copy of the first, is the look-ahead. Reading that batch draws the
DataLoader's base seed from the global RNG: the RNG state is put back afterwards.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import DataLoader

__all__ = ["AccelerateStep", "traced_batch", "inner_optimizer", "step_state",
           "check_supported", "prepare_copy", "MICRO", "AHEAD"]

MICRO = "micro_batches"      # the traced batch: {MICRO: [micro-batch, ...], AHEAD: batch}
AHEAD = "look_ahead"


def check_supported(accelerator) -> None:
    """A ValueError naming what this step does not model (Note 2): several processes,
    DeepSpeed / FSDP / Megatron, a loss scaler."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"give the accelerate.Accelerator the loop uses, got "
                         f"{type(accelerator).__name__} (the arguments are accelerator, model, "
                         "optimizer, batch)")
    bad = []
    if accelerator.num_processes > 1:
        bad.append(f"num_processes={accelerator.num_processes} (estimate one rank with "
                   "memfit.estimate(gpus=...))")
    if accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP,
                                        DistributedType.MEGATRON_LM, DistributedType.XLA):
        bad.append(f"distributed_type={accelerator.distributed_type}")
    if accelerator.scaler is not None:
        bad.append("fp16 loss scaling (accelerator.scaler; use mixed_precision='bf16', or "
                   "memfit.estimate(model, batch, precision='fp16') for memfit's own step)")
    if bad:
        raise ValueError("memfit.integrations.accelerate models a single-process eager "
                         f"Accelerator; this one has {', '.join(bad)}")


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or the one given)."""
    from accelerate.optimizer import AcceleratedOptimizer
    if isinstance(optimizer, AcceleratedOptimizer):
        return optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer: give the optimizer accelerator.prepare returned (or a "
                         f"torch.optim.Optimizer), got {type(optimizer).__name__}")
    return optimizer


def traced_batch(accelerator, batch) -> dict:
    """The micro-batches of one optimizer step, and a DataLoader's look-ahead (Note 4)."""
    g = accelerator.gradient_accumulation_steps
    if isinstance(batch, DataLoader):
        first = _first_batch(accelerator, batch)
        out = {MICRO: [first] * g}
        if _reads_ahead(batch):
            out[AHEAD] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                                  first)
        return out
    if isinstance(batch, Mapping):
        return {MICRO: [batch] * g}
    if isinstance(batch, Sequence) and batch and all(isinstance(b, Mapping) for b in batch):
        if len(batch) != g:
            raise ValueError(f"batch: {len(batch)} micro-batches given, but one optimizer step "
                             f"of this Accelerator is gradient_accumulation_steps={g} of them; "
                             f"give {g} (or one, used for each)")
        return {MICRO: list(batch)}
    raise ValueError(f"batch: give the DataLoader, one batch as it yields it (a Mapping of "
                     f"tensors, called as model(**batch)) or a list of "
                     f"gradient_accumulation_steps of them, got {type(batch).__name__}")


def _reads_ahead(loader) -> bool:
    from accelerate.data_loader import DataLoaderShard
    return isinstance(loader, DataLoaderShard)


def _first_batch(accelerator, loader):
    """The loader's first batch on the accelerator's device, the RNG state kept (Note 4);
    a prepared loader is read through its base loader (its own iterator would register with
    the accelerator's gradient state)."""
    from accelerate.utils import send_to_device
    base = getattr(loader, "base_dataloader", loader)
    with torch.random.fork_rng(devices=[]):
        try:
            batch = next(iter(base))
        except StopIteration:
            raise ValueError("batch: the DataLoader is empty") from None
    if not isinstance(batch, Mapping):
        raise ValueError(f"batch: the DataLoader yields {type(batch).__name__}, but the loop "
                         "body calls model(**batch); give step=body for other batches")
    return send_to_device(batch, accelerator.device)


@contextlib.contextmanager
def step_state(accelerator):
    """Note 3: start at a step boundary, restore the loop's counters afterwards."""
    gs = accelerator.gradient_state
    saved, sync, loaders = accelerator.step, gs.sync_gradients, gs.dataloader_references
    accelerator.step = 0
    gs.dataloader_references = [None]     # a mid-epoch step: not the end of a dataloader
    try:
        yield
    finally:
        accelerator.step = saved
        gs.dataloader_references = loaders
        gs._set_sync_gradients(sync)


def prepare_copy(accelerator, model: nn.Module) -> None:
    """Accelerate's autocast wrapper on a fake copy that lacks it (Note 2)."""
    if accelerator.native_amp and "_original_forward" not in vars(model):
        accelerator.prepare_model(model, device_placement=False)
        accelerator._models[:] = [m for m in accelerator._models if m is not model]


@dataclass
class _Carry:
    wrapped: object = None          # AcceleratedOptimizer over the fake optimizer
    inner: object = None            # the optimizer it wraps
    last: object = None             # what the last body returned (the loop's ``loss``)


class AccelerateStep:
    """``fn(model, micro_batches, optimizer)``: one optimizer step of the loop (Note 1)."""

    def __init__(self, accelerator, body: Callable | None = None,
                 max_grad_norm: float | None = None):
        if body is not None and max_grad_norm is not None:
            raise ValueError("max_grad_norm with step=body: clip inside the body "
                             "(accelerator.clip_grad_norm_); leave max_grad_norm unset")
        if body is not None and not callable(body):
            raise ValueError(f"step: give the loop body fn(model, batch, optimizer), got "
                             f"{type(body).__name__}")
        self.accelerator = accelerator
        self.body = body
        self.max_grad_norm = max_grad_norm
        self._carry: "weakref.WeakKeyDictionary[nn.Module, _Carry]" = weakref.WeakKeyDictionary()
        self.__qualname__ = getattr(body, "__qualname__", "accelerate loop body")

    def __call__(self, model, micro_batches, optimizer):      # Note 4's traced batch
        from accelerate.optimizer import AcceleratedOptimizer
        acc = self.accelerator
        carry = self._carry.setdefault(model, _Carry())
        if carry.inner is not optimizer:
            prepare_copy(acc, model)
            carry.inner = optimizer
            carry.wrapped = AcceleratedOptimizer(optimizer, device_placement=False)
        _touch(micro_batches)          # alive all step, counted from the start (Note 4)
        for batch in micro_batches[MICRO]:
            with acc.accumulate(model):
                if self.body is None:
                    self._default_body(model, batch, carry)
                else:        # ``loss = body(...)``: the last result lives until this returns
                    carry.last = self.body(model, batch, carry.wrapped)
        return None

    def _default_body(self, model, batch, carry: _Carry) -> None:
        """Note 1's body; ``carry.last`` is the loop's ``loss`` variable."""
        acc, optimizer = self.accelerator, carry.wrapped
        carry.last = model(**batch).loss       # the previous step's loss is dropped here
        acc.backward(carry.last)
        if self.max_grad_norm is not None and acc.sync_gradients:
            acc.clip_grad_norm_(model.parameters(), self.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()


def _touch(batch) -> None:
    """A view of every tensor of the traced batch: a tracker counts a storage alive before the
    trace from the first op that sees it, and the look-ahead batch is seen by no other op."""
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            t.detach()
