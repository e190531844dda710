"""A shallow twin of a model: the same model with fewer of its repeated blocks.

``BlockList.of(model)`` finds the blocks (``measure._modules.find_blocks``) when they are the
children of one ``ModuleList``/``Sequential`` and the middle ones (all but the first and the
last) are alike: the same classes, parameter and buffer shapes, dtypes and flags, and the same
plain attributes in every submodule (a layer index apart). ``twin(indices)`` is the model with
that list holding only the blocks at ``indices``: a shallow copy of each module on the path to
the list (their ``_modules`` dicts copied), so the user's model is not touched and the twin
shares its blocks and tied weights. Those modules see a copy of the model's config with the
twin's depth (``num_hidden_layers``, per-layer ``layer_types``), and a block the twin puts at
another place has its layer index (``layer_idx``) renumbered: a KV cache made from the config
in forward has a layer per block, as the model's has.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import torch
from torch import nn

from memfit.measure._modules import find_blocks

__all__ = ["BlockList", "TWIN_A", "TWIN_B", "MID", "PER_LAYER_NAMES"]

MID = 2                     # twin A's block that ``trace.block_reuse`` repeats


def TWIN_A(n: int) -> list[int]:
    """The blocks of twin A, for a model of ``n``: the first, three alike, the last."""
    return [0, 1, 2, 3, n - 1]


def TWIN_B(n: int) -> list[int]:
    """Twin A without its middle block: the check of the composition."""
    return [0, 1, 2, n - 1]

# config fields that give the depth, and those that hold one value per layer
_DEPTH_NAMES = frozenset({"num_hidden_layers", "n_layer", "num_layers", "n_layers"})
PER_LAYER_NAMES = frozenset({"layer_types", "sliding_window_pattern_list", "mlp_only_layers"})

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
        chosen = [_renumbered(holder[i], i, j) for j, i in enumerate(indices)]
        short = type(holder)(chosen) if isinstance(holder, nn.Sequential) \
            else nn.ModuleList(chosen)
        config = self._config(indices)
        original = getattr(self.model, "config", None)
        root = _shallow(self.model, original, config)
        copies = {id(self.model): root}
        parent = root
        *inner, last = self.path.split(".")
        for part in inner:
            child = _shallow(parent._modules[part], original, config)
            copies[id(parent._modules[part])] = child
            parent._modules[part] = child
            parent = child
        parent._modules[last] = short
        for module in copies.values():
            _repointed(module, copies)
        return root

    def _config(self, indices: list[int]):
        """The model's config with its depth as the twin's (a KV cache built from the config
        has one layer per block): a shallow copy, its depth fields and per-layer lists cut to
        ``indices``; None where the model has no config that names this depth."""
        config = getattr(self.model, "config", None)
        if config is None or not hasattr(config, "__dict__"):
            return None
        fields = {k: v for k, v in vars(config).items()
                  if (k in _DEPTH_NAMES and v == self.count) or
                  (isinstance(v, list) and len(v) == self.count and k in PER_LAYER_NAMES)}
        if not fields:
            return None
        twin = copy.copy(config)
        for k, v in fields.items():
            setattr(twin, k, [v[i] for i in indices] if isinstance(v, list) else len(indices))
        return twin


def _shallow(m: nn.Module, original, config) -> nn.Module:
    """A shallow copy of ``m``, holding the twin's ``config`` where ``m`` held the model's
    ``original`` one."""
    out = copy.copy(m)
    out._modules = dict(m._modules)
    if config is not None and getattr(m, "config", None) is original:
        out.config = config
    return out


def _repointed(module: nn.Module, copies: dict) -> None:
    """A plain attribute of ``module`` that holds a module on the path, or a method bound to
    one (peft's PeftModel keeps the base model's ``prepare_inputs_for_generation``), now holds
    its twin's copy: else a deep copy of the twin would copy the whole model through it (and
    fail on bitsandbytes' quantized weights, which do not deep-copy on meta)."""
    for k, v in list(vars(module).items()):
        if k.startswith("_"):
            continue
        if isinstance(v, nn.Module) and id(v) in copies:
            module.__dict__[k] = copies[id(v)]
        elif isinstance(v, types.MethodType) and id(v.__self__) in copies:
            module.__dict__[k] = types.MethodType(v.__func__, copies[id(v.__self__)])


def _renumbered(block: nn.Module, old: int, new: int) -> nn.Module:
    """``block`` as the twin's block ``new``: where a submodule numbers its layer ``old`` (a
    cache's index), a shallow copy numbered ``new``, sharing the parameters."""
    if old == new or not any(getattr(m, k, None) == old for m in block.modules()
                             for k in _INDEX_NAMES):
        return block
    out = copy.copy(block)
    out._modules = {k: _renumbered(m, old, new) if m is not None else None
                    for k, m in block._modules.items()}
    for k in _INDEX_NAMES:
        if getattr(block, k, None) == old and isinstance(old, int):
            setattr(out, k, new)
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
