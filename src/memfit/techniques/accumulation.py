"""Gradient accumulation: one effective batch as several micro-batches, exactly.

Note 1 (normalisation). A model's loss is a mean over what it counts in *its* micro-batch
(tokens whose label is not -100, samples, ...). Averaging those means is wrong whenever
micro-batches count different amounts (padding!). Each micro-batch's loss is therefore
weighted by ``count_i * world / total``, where ``total`` is the count of the whole effective
batch on all ranks: the gradient is then the one of the full-batch mean, after DDP/FSDP average
over the ``world`` ranks. With one micro-batch on one rank the weight is 1 and is not applied.

Note 2 (what the model counts). A causal LM shifts its labels by one position, so it counts
``labels[..., 1:] != -100``; other token-level losses (masked LM, token classification,
seq2seq) count ``labels != -100``; anything else counts samples. ``count_fn(batch)`` overrides.

Note 3 (synchronisation). Under DDP the first M-1 micro-batches run in ``no_sync()``, so
gradients are all-reduced once, on the last micro-batch: every rank holds the whole gradient
either way. Under FSDP2 every micro-batch reduce-scatters its gradients and each rank adds its
shard to its sharded gradient: FSDP2's no-sync (``set_requires_gradient_sync(False)``) would
keep every block's gradients unsharded until the last micro-batch, the whole model's gradients
on each rank (Llama-2-7B: 25 GiB in fp32), which is what sharding is there to avoid. The
price is one reduce-scatter per micro-batch, which the sharding planner times
(docs/techniques/sharding.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from memfit.techniques._protocol import Change

__all__ = ["Accumulation", "batch_size_of", "unwrap"]

_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def batch_size_of(batch) -> int:
    """The batch size: the first dimension most of the batch's tensors share."""
    leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not leaves:
        raise ValueError(f"the batch ({type(batch).__name__}) holds no tensors: give a mapping "
                         "(or tuple) of tensors shaped [batch, ...], e.g. from a DataLoader")
    dims = [t.shape[0] for t in leaves if t.dim() > 0]
    if not dims:
        raise ValueError("the batch has no tensor with a batch dimension (every tensor is a "
                         "scalar): give tensors shaped [batch, ...]")
    # symbolic sizes (a trace shared by several shapes) are not hashable: count their
    # expressions
    keys = [d.node.expr if isinstance(d, torch.SymInt) else d for d in dims]
    return dims[keys.index(max(set(keys), key=keys.count))]


class Accumulation:
    """Split an effective batch, count what each micro-batch's loss averages over, sync once."""

    @dataclass(frozen=True)
    class Config:
        micro_batch_size: int | None = None   # samples per micro-batch; None: the whole batch

    def __init__(self, config: "Accumulation.Config", count_fn: Callable | None = None):
        self.config = config
        self.count_fn = count_fn

    def apply(self, model: nn.Module) -> Change:
        """Nothing changes on the model or the optimizer: the Runner runs each effective batch
        through this object (``split``, ``count``, ``sync``). An empty ``Change``."""
        return Change(model)

    def split(self, batch) -> list:
        """Micro-batches: tensors whose first dimension is the batch size are cut into chunks
        of ``micro_batch_size`` (the last may be smaller); everything else passes through."""
        b = batch_size_of(batch)
        m = self.config.micro_batch_size or b
        if m >= b:
            return [batch]
        starts = range(0, b, m)
        cut = lambda t, s: t[s:s + m] if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b else t
        return [tree_map(lambda t, s=s: cut(t, s), batch) for s in starts]

    def count(self, model: nn.Module, micro_batch) -> torch.Tensor | int:
        """What the model's loss averages over in this micro-batch (Note 2)."""
        if self.count_fn is not None:
            return self.count_fn(micro_batch)
        labels = micro_batch.get("labels") if isinstance(micro_batch, Mapping) else None
        if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and not labels.is_floating_point():
            if type(unwrap(model)).__name__.endswith(_CAUSAL_SUFFIXES):
                labels = labels[..., 1:]
            return (labels != -100).sum()
        return batch_size_of(micro_batch)

    @staticmethod
    def sync(model: nn.Module, last: bool):
        """Context for one micro-batch: under DDP, all-reduce gradients only on the last one;
        FSDP2 reduce-scatters every micro-batch's (Note 3)."""
        if isinstance(model, nn.parallel.DistributedDataParallel) and not last:
            return model.no_sync()
        return contextlib.nullcontext()

    def warn_if_inexact(self, model: nn.Module, batch) -> None:
        m = self.config.micro_batch_size
        b = batch_size_of(batch)
        if m is None or m >= b:
            return
        if any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in model.modules()):
            warnings.warn(
                f"the model has BatchNorm: with micro-batches of {m} its statistics are computed "
                f"over {m} samples, not the effective batch of {b}, so accumulation cannot equal "
                "the full-batch step exactly (use GroupNorm/LayerNorm, or micro_batch_size="
                f"{b})", stacklevel=3)
