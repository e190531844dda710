"""Optimizer-state offload: the optimizer steps fp32 host copies of the parameters (ZeRO-Offload
for one device).

``OptimizerOffload.apply`` rebuilds the user's optimizer over host twins of the parameters and
puts an ``OffloadedOptimizer`` in its place; how that optimizer steps, what it counts as host
memory, and how it moves each gradient to the host as backward makes it (``offload_gradients``)
are the notes of ``techniques._offloaded_optimizer``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memfit.optimizers import rebuild_optimizer
from memfit.techniques._bnb_optimizer import is_bnb, rebuild_bnb
from memfit.techniques._offloaded_optimizer import Copy, OffloadedOptimizer
from memfit.techniques._protocol import Change
from memfit.techniques._torchao_optimizer import is_torchao
from memfit.techniques._torchao_user import rebuild_torchao

__all__ = ["OptimizerOffload", "OffloadedOptimizer"]

_NOTE = ("offload_optimizer: the optimizer was rebuilt over fp32 host copies of the "
         "parameters (runner.optimizer); its state and step live in host memory")

_GRADS_NOTE = ("offload_gradients: each gradient is copied to its host copy as backward "
               "produces it and freed on the device; micro-batches accumulate on the host")


class OptimizerOffload:
    """Keep the optimizer's state and fp32 parameter copies in host memory (an
    ``OffloadedOptimizer``)."""

    @dataclass(frozen=True)
    class Config:
        enabled: bool = True
        chunk_bytes: int | None = None   # host-gradient bytes in flight per inner step; None: all
        offload_gradients: bool = False  # each gradient to the host as backward makes it

        def __post_init__(self):
            if self.chunk_bytes is not None and (isinstance(self.chunk_bytes, bool)
                                                 or not isinstance(self.chunk_bytes, int)
                                                 or self.chunk_bytes <= 0):
                raise ValueError(f"OptimizerOffload.Config.chunk_bytes={self.chunk_bytes!r} must "
                                 "be a positive int (bytes) or None")
            if self.offload_gradients and self.chunk_bytes is not None:
                raise ValueError("OptimizerOffload.Config: offload_gradients keeps every host "
                                 "gradient from backward on, so chunk_bytes bounds nothing; "
                                 "leave chunk_bytes None")

    def __init__(self, config: "OptimizerOffload.Config", *, copy_to_host: Copy | None = None,
                 copy_to_device: Copy | None = None):
        self.config = config
        # (dst, src) -> None; default ``dst.copy_(src, non_blocking=pinned)``. A trace for a GPU
        # may pass models of the transfers.
        self.copy_to_host = copy_to_host
        self.copy_to_device = copy_to_device

    def apply(self, model: nn.Module, optimizer) -> Change:
        """Offload ``optimizer``: an instance over ``model``'s device parameters (rebuilt over
        the twins; any state it has is carried over), or a factory ``params -> Optimizer``,
        called with the model's trainable parameters. The ``Change``'s ``optimizer`` is the
        ``OffloadedOptimizer`` to step; disabled, the optimizer itself (the factory's)."""
        if isinstance(optimizer, torch.optim.Optimizer):
            if isinstance(optimizer, OffloadedOptimizer):
                raise ValueError("the optimizer is already offloaded")
            if not self.config.enabled:
                return Change(model, optimizer=optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            build = lambda twins: _rebuild(optimizer, params, twins)   # noqa: E731
        elif callable(optimizer):
            params = [p for p in model.parameters() if p.requires_grad]
            if not self.config.enabled:
                return Change(model, optimizer=optimizer(params))
            build = optimizer
        else:
            raise ValueError("OptimizerOffload.apply takes a torch.optim.Optimizer or a factory "
                             f"params -> Optimizer; got {type(optimizer).__name__}")
        wrapped = OffloadedOptimizer(params, build, chunk_bytes=self.config.chunk_bytes,
                                     copy_to_host=self.copy_to_host,
                                     copy_to_device=self.copy_to_device)
        return self._change(model, wrapped)

    def _change(self, model: nn.Module, wrapped: OffloadedOptimizer) -> Change:
        """The ``Change`` of ``wrapped``, with its gradient hooks if asked
        (``OffloadedOptimizer.gradients_to_host``; reapplied by registering them again)."""
        if not self.config.offload_gradients:
            return Change(model, optimizer=wrapped, optimizer_rebuilt=True, notes=(_NOTE,))
        return Change(model, optimizer=wrapped, optimizer_rebuilt=True,
                      notes=(_NOTE, _GRADS_NOTE), hooks=wrapped.gradients_to_host(),
                      on_remove=wrapped.gradients_on_device,
                      redo=lambda: self._change(model, wrapped))


def _rebuild(optimizer: torch.optim.Optimizer, params: list, twins: list) -> torch.optim.Optimizer:
    """``optimizer``'s class and groups over ``twins``, with a copy of its state (if any)."""
    new_of = {id(p): h for p, h in zip(params, twins)}
    # a bitsandbytes optimizer keeps args and per-parameter overrides outside its defaults,
    # torchao's its block size (and its own step compiles)
    if is_bnb(optimizer):
        inner = rebuild_bnb(optimizer, new_of)
    elif is_torchao(optimizer):
        inner = rebuild_torchao(optimizer, new_of, steps="eager")   # memfit steps it, on the host
    else:
        inner = rebuild_optimizer(optimizer, new_of)
    if optimizer.state:
        saved = optimizer.state_dict()
        # copies: torch's load_state_dict keeps tensors already on the right device as they are,
        # and the state must not stay shared with the optimizer it replaces
        saved["state"] = {i: {k: v.detach().to(twins[0].device, copy=True)
                              if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for i, s in saved["state"].items()}
        inner.load_state_dict(saved)
    return inner
