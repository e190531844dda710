"""Fake copies of a model, a batch and tensors: same shapes, dtypes, sharing; no memory.

Note 1 (the copy). The model is deep-copied with its parameters and buffers pre-seeded in the
deepcopy memo by their fake counterparts, so the copy shares nothing with the user's model,
tied parameters stay tied (one object, one fake), hooks and config come along, and no real
tensor data is duplicated. Real tensors become fakes with ``from_tensor`` (storage size and
sharing kept); ``meta`` tensors become fakes on ``device`` with the same shape and strides.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from memfit.trace.data_dependent import DataValues

__all__ = ["FakeCopier"]


class FakeCopier:
    """Turns real or meta tensors (and modules holding them) into fakes of one FakeTensorMode."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.mode = FakeTensorMode(allow_non_fake_inputs=False)
        self._memo: dict[int, torch.Tensor] = {}
        # the real values of the integer/bool tensors faked (ids, labels, masks), for the
        # data-dependent ops of a trace (memfit.trace.data_dependent Note 1)
        self.data = DataValues()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) in self._memo:
            return self._memo[id(t)]
        if t.device.type == "meta":
            with self.mode:
                fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)
        else:
            fake = self._from_real(t.detach())
        if isinstance(t, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
        elif t.requires_grad:
            fake.requires_grad_(True)
        self.data.offer(fake, t)
        self._memo[id(t)] = fake
        return fake

    def _from_real(self, t: torch.Tensor) -> torch.Tensor:
        return self.mode.from_tensor(t)

    def tree(self, obj):
        """Fake every tensor in a pytree (dicts, lists, tuples); leave other leaves alone."""
        return tree_map(lambda x: self.tensor(x) if isinstance(x, torch.Tensor) else x, obj)

    def module(self, model: nn.Module) -> nn.Module:
        """A fake deep copy of ``model`` (Note 1); the user's model is not touched."""
        memo = {}
        for m in model.modules():
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None:
                    memo[id(t)] = self.tensor(t)
        return copy.deepcopy(model, memo)
