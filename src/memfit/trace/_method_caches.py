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
import functools
import types

from torch import nn

__all__ = ["caches_cleared"]


def _caches(model: nn.Module) -> list:
    """The ``functools.lru_cache`` wrappers among the methods of the model's module classes:
    a method (static, class or plain) that is one, or a plain function holding one in its
    closure (transformers' wrapper). Nothing else of a class is read."""
    found, seen = {}, set()
    for m in model.modules():
        for cls in type(m).__mro__:
            if cls in seen or cls is nn.Module or cls is object:
                continue
            seen.add(cls)
            for value in vars(cls).values():
                if isinstance(value, (staticmethod, classmethod)):
                    value = value.__func__
                inner = _closure(value) if isinstance(value, types.FunctionType) else []
                for c in (value, *inner):
                    if isinstance(c, _LRU):
                        found[id(c)] = c
    return list(found.values())


_LRU = functools._lru_cache_wrapper


def _closure(fn: types.FunctionType) -> list:
    out = []
    for cell in fn.__closure__ or ():
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
