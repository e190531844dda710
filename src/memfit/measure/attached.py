"""Tensors a parameter holds in its attributes: the state of a quantized weight.

A quantized base weight keeps more than its own storage. bitsandbytes' ``Params4bit`` (NF4 /
FP4, QLoRA's base) packs two 4-bit codes per byte in the parameter and keeps the rest in
``p.quant_state``: the per-block scales (``absmax``: fp32, or uint8 under double quantization
with a second ``state2`` of fp32 scales, its code book and ``offset``) and the 16-value code
book. ``Int8Params`` (LLM.int8) keeps its row scales in ``p.SCB``. Those tensors live as long as
the weight, on its device, and the step's kernels read them; they are the weight's bytes.

``attached(p, fn)`` walks a parameter's ``__dict__`` and gives each attribute with every tensor
replaced by ``fn(tensor)``: in a tensor, a list/tuple/dict of them, or an object (such as
``QuantState``) whose own attributes hold one, copied shallowly (to ``DEPTH`` levels:
``quant_state.state2.absmax``); the other attributes (``quant_type``, ``CB=None``, flags) as
they are. Modules (``Params4bit.module``, a back-reference) and dispatch modes (a fake tensor's
``fake_mode``) are left out. The fake copy of a
model (``trace.fake``) gives its fakes these attributes with fake tensors, and the counter
(``measure.track``) counts them as parameters from the start, so a trace and a real step see
the same weight.

A module may hold the same kind of state outside its parameters and buffers:
``Linear8bitLt.state`` (a ``MatmulLtState``) keeps the int8 weight ``CB`` and its row scales
``SCB`` once the first forward moved them off the parameter. ``module_tensors(m)`` finds the
tensors in a module's plain attributes, by the same walk: the fake copy fakes them too (a deep
copy would otherwise copy them as real tensors into the trace), and the counter counts them
from the start.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["attached", "attached_tensors", "module_tensors", "DEPTH"]

# nn.Module's own bookkeeping: parameters, buffers and submodules are counted as such
_MODULE_OWN = frozenset(vars(nn.Module()))

DEPTH = 3

# never a weight's state: a module (a back-reference), and a dispatch mode (every fake tensor
# holds its ``fake_mode``, whose caches the walk would otherwise search on every fake it is
# asked about: a twentieth of a plan's time went there)
_NOT_STATE = (nn.Module, TorchDispatchMode)


def attached(p: torch.Tensor, fn: Callable[[torch.Tensor], object]) -> dict[str, object]:
    """``{name: value with every tensor t replaced by fn(t)}`` for the attributes of ``p``
    that hold a tensor (the module note)."""
    own = _fake_own() if isinstance(p, FakeTensor) else ()
    return {name: _mapped(value, fn, DEPTH) for name, value in vars(p).items()
            if name not in own and not isinstance(value, _NOT_STATE)}


@functools.cache
def _fake_own() -> frozenset[str]:
    """The attributes a fake tensor (a parameter among them) keeps for ``FakeTensorMode``
    itself (its device, mode, lifted constant, memos of data-dependent answers): never a
    weight's state, and a score of them on every fake, each walked at every ask (a fake
    parameter's ask cost 19 us, a plan asks thousands). Made on a fake of its own, seen by
    no mode of a trace or tracker that may be running."""
    with _disable_current_modes(), torch._C.DisableTorchFunction(), FakeTensorMode():
        t = torch.empty(0)
        return frozenset(vars(t)) | frozenset(vars(nn.Parameter(t)))


def attached_tensors(p: torch.Tensor) -> Iterator[torch.Tensor]:
    """Every tensor the attributes of ``p`` hold, once each."""
    return _collected(lambda note: attached(p, note))


def module_tensors(m: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor in ``m``'s own plain attributes (not its parameters, buffers, submodules
    or hooks), once each."""
    return _collected(lambda note: [_mapped(v, note, DEPTH) for n, v in vars(m).items()
                                    if n not in _MODULE_OWN and not isinstance(v, nn.Module)])


def _collected(walk) -> Iterator[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}

    def note(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(id(t), t)
        return t

    walk(note)
    return iter(seen.values())


def _holds_tensor(value, depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0 or isinstance(value, (*_NOT_STATE, str, bytes, type)):
        return False
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth - 1) for v in value.values())
    if hasattr(value, "__dict__") and not callable(value):
        return any(_holds_tensor(v, depth - 1) for v in vars(value).values())
    return False


def _mapped(value, fn, depth: int):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if not _holds_tensor(value, depth):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(v, fn, depth - 1) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(v, fn, depth - 1) for k, v in value.items()}
    new = copy.copy(value)
    for name, v in vars(value).items():
        if _holds_tensor(v, depth - 1):
            setattr(new, name, _mapped(v, fn, depth - 1))
    return new
