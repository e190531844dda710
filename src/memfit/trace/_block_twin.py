"""A shallow twin of a model: the same model with fewer of its repeated blocks.

``BlockList.of(model)`` finds the blocks (``measure._modules.find_blocks``) when they are the
children of one ``ModuleList``/``Sequential`` and the middle ones (all but the first and the
last) are alike: the same classes, parameter and buffer shapes, dtypes and flags, and the same
plain attributes in every submodule (a layer index apart). ``twin(indices)`` is the model with
that list holding only the blocks at ``indices``: a shallow copy of each module on the path to
the list (their ``_modules`` dicts copied), so the user's model is not touched and the twin
shares its blocks, its tied weights and its config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from memfit.measure._modules import find_blocks

__all__ = ["BlockList"]

# attributes that number a layer without changing what it computes
_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "idx",
                          "block_idx", "layer_num"})


@dataclass(frozen=True)
class BlockList:
    """The model's repeated blocks: the path of their list and how many there are."""

    model: nn.Module
    path: str              # qualified name of the ModuleList ("" never: a root list is no model)
    count: int

    @staticmethod
    def of(model: nn.Module) -> "BlockList | str":
        """The block list, or why a composed step cannot be made for this model."""
        names = find_blocks(model)
        if len(names) < 2:
            return "the model has no repeated blocks"
        parents = {n.rpartition(".")[0] for n in names}
        if len(parents) != 1 or "" in parents:
            return "its blocks are not the children of one list"
        path = parents.pop()
        holder = model.get_submodule(path)
        if not isinstance(holder, (nn.ModuleList, nn.Sequential)) or \
                [f"{path}.{k}" for k, _ in holder.named_children()] != names or \
                [k for k, _ in holder.named_children()] != [str(i) for i in range(len(names))]:
            return "its blocks are not the whole of one list"
        prints = [_fingerprint(b) for b in holder]
        if any(p != prints[1] for p in prints[1:-1]):
            odd = next(i for i, p in enumerate(prints[1:-1], 1) if p != prints[1])
            return f"its middle blocks differ (block {odd} is not like block 1)"
        return BlockList(model, path, len(names))

    def names(self, count: int | None = None) -> list[str]:
        return [f"{self.path}.{i}" for i in range(self.count if count is None else count)]

    def twin(self, indices: list[int]) -> nn.Module:
        """The model with its list holding the blocks at ``indices`` only (renumbered)."""
        holder = self.model.get_submodule(self.path)
        short = type(holder)([holder[i] for i in indices]) if isinstance(holder, nn.Sequential) \
            else nn.ModuleList([holder[i] for i in indices])
        root = _shallow(self.model)
        parent = root
        *inner, last = self.path.split(".")
        for part in inner:
            child = _shallow(parent._modules[part])
            parent._modules[part] = child
            parent = child
        parent._modules[last] = short
        return root


def _shallow(m: nn.Module) -> nn.Module:
    out = copy.copy(m)
    out._modules = dict(m._modules)
    return out


def _fingerprint(block: nn.Module) -> tuple:
    out = []
    for name, m in block.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in _INDEX_NAMES and
                             isinstance(v, (int, float, str, bool, type(None)))))
        tensors = tuple((k, tuple(t.shape), t.dtype, t.requires_grad, t.device.type,
                         type(t).__name__)
                        for k, t in list(m._parameters.items()) + list(m._buffers.items())
                        if isinstance(t, torch.Tensor))
        out.append((name, type(m).__name__, attrs, tensors, m.training))
    return tuple(out)
