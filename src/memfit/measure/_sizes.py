"""Sizes that may be symbolic: a trace shared by several batch shapes (``api._shared_shapes``).

Such a trace runs its batch with symbolic dimensions, so a storage's ``nbytes()`` is a
``SymInt``. The counters keep two things for it: its value in the traced shape (``hint``, an
int read without adding a guard: they only count bytes and FLOPs with it and decide nothing)
and its expression (``expr``), which gives the same storage's size in any other shape.
"""

from __future__ import annotations

import torch

__all__ = ["hint", "expr"]


def hint(n) -> int:
    """``n`` as an int: itself, or a SymInt's value in the traced shape, without a guard."""
    if not isinstance(n, torch.SymInt):
        return n
    node = n.node
    if node.hint is not None:
        return int(node.hint)
    return int(node.shape_env.size_hint(node.expr))


def expr(n):
    """A SymInt's sympy expression, or None for a plain int."""
    return n.node.expr if isinstance(n, torch.SymInt) else None
