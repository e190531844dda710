"""Method caches a trace must not fill with its fakes.

A model's code may cache a tensor it builds once per class: transformers' BEiT caches
``generate_relative_position_index`` with ``functools.lru_cache`` (through its
``compile_compatible_method_lru_cache``, which hides the cache in a closure). Built inside a
trace, the cached tensor is a fake of that trace's mode: the next trace (another mode) fails
with "Mixing fake modes", and a real step after ``estimate`` fails on a fake among real
tensors. ``caches_cleared(model)`` empties every such cache of the model's module classes
before the trace (a real tensor cached by the user's own run is not a fake) and after it.
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["caches_cleared"]


def _caches(model: nn.Module) -> list:
    """The ``cache_clear``-able functions among the methods of the model's module classes
    (a static or class method, or a wrapper holding one in its closure)."""
    found, seen = {}, set()
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls in seen or cls is nn.Module or cls is object:
                continue
            seen.add(cls)
            for value in vars(cls).values():
                fn = getattr(value, "__func__", value)          # staticmethod, classmethod
                for c in (fn, *_closure(fn)):
                    if callable(getattr(c, "cache_clear", None)):
                        found[id(c)] = c
    return list(found.values())


def _closure(fn) -> list:
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:              # an empty cell
            pass
    return out


@contextlib.contextmanager
def caches_cleared(model: nn.Module):
    """Every method cache of ``model``'s classes emptied before and after the block."""
    caches = _caches(model)
    for c in caches:
        c.cache_clear()
    try:
        yield
    finally:
        for c in caches:
            c.cache_clear()
