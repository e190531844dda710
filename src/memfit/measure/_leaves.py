"""The leaves of an op's arguments or results, fast.

Every op a counting mode sees passes its arguments and results through a flatten, several
times (the counter, the labels, the data-dependence mirror). ``torch.utils._pytree.tree_flatten``
builds a ``TreeSpec`` each time and looks each node's type up in its registry: about a tenth of
a fake trace's time. An aten op's arguments and results are only ever lists, tuples (named ones,
``torch.Size`` and ``torch.return_types`` among them) and the kwargs dict, so ``leaves`` walks
those directly and gives the leaves in ``tree_flatten``'s order (a dict's values in its own
order); anything else is a leaf. Use it on what the dispatcher passes, not on a user's pytree
(a dataclass or a registered node would be a leaf here).
"""

from __future__ import annotations

import torch

__all__ = ["leaves", "tensors"]

_CONTAINERS = (list, tuple)


def leaves(tree) -> list:
    """``tree_flatten(tree)[0]`` for an op's arguments or results (module docstring)."""
    out: list = []
    _walk(tree, out)
    return out


def _walk(x, out: list) -> None:
    if isinstance(x, _CONTAINERS):
        for y in x:
            if isinstance(y, (list, tuple, dict)):
                _walk(y, out)
            else:
                out.append(y)
    elif isinstance(x, dict):
        for y in x.values():
            if isinstance(y, (list, tuple, dict)):
                _walk(y, out)
            else:
                out.append(y)
    else:
        out.append(x)


def tensors(tree) -> list[torch.Tensor]:
    """The tensors among ``leaves(tree)``, in order."""
    return [x for x in leaves(tree) if isinstance(x, torch.Tensor)]
