"""What the counters need to follow a ``torch.compile``d region (docs/compiled.md).

Dynamo refuses to compile, and runs the eager code instead, while a dispatch mode that is not
PyTorch's own is active, unless every such mode says it *ignores compile internals*: Dynamo
then turns those modes off while it compiles and back on while the compiled code runs, so a mode
sees the kernels and buffers the compiler's code launches and allocates, not the eager ops
(``TorchDispatchMode.ignore_compile_internals``). memfit's counting modes say so only inside
``following_compiled()``, which the trace of a compiled job enters: anywhere else a compiled
function under a trace runs eagerly, as it always has.

A compiled region is one call to the counters: the modules inside it run inside the compiled
code, so their hooks would be traced into the graph, not run; ``watched_modules`` skips them
and watches the region's wrapper (``OptimizedModule``) itself.
"""

from __future__ import annotations

import contextlib

from torch import nn

__all__ = ["CompileAware", "following_compiled", "is_compiled_wrapper", "is_compiled_in_place",
           "has_compiled", "watched_modules"]

_FOLLOWING = [0]          # nesting depth of following_compiled()


class CompileAware:
    """Mixed into a memfit ``TorchDispatchMode``: it follows compiled code inside
    ``following_compiled()`` (module docstring)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return _FOLLOWING[0] > 0


@contextlib.contextmanager
def following_compiled():
    """memfit's modes let Dynamo compile under them and see the compiled code run."""
    _FOLLOWING[0] += 1
    try:
        yield
    finally:
        _FOLLOWING[0] -= 1


def is_compiled_wrapper(m: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper (``OptimizedModule``), told without importing
    Dynamo."""
    return type(m).__name__ == "OptimizedModule" and "_orig_mod" in m._modules


def is_compiled_in_place(m: nn.Module) -> bool:
    """A module compiled by ``module.compile()`` (its call goes through the compiled one)."""
    return getattr(m, "_compiled_call_impl", None) is not None


def has_compiled(model: nn.Module) -> bool:
    """Whether any module of ``model`` runs compiled (a wrapper, or ``module.compile()``)."""
    return any(is_compiled_wrapper(m) or is_compiled_in_place(m) for m in model.modules())


def watched_modules(model: nn.Module, remove_duplicate: bool = True):
    """``model.named_modules()`` without what runs inside a compiled wrapper."""
    inside: list[str] = []
    for name, m in model.named_modules(remove_duplicate=remove_duplicate):
        if any(name == p or name.startswith(p + ".") for p in inside):
            continue
        yield name, m
        if is_compiled_wrapper(m):
            inside.append(f"{name}._orig_mod" if name else "_orig_mod")
