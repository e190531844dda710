"""Estimates kept across runs: ``memfit.estimate``'s answer stored in memfit's disk cache.

A front that has a cache (the CLI: ``memfit._cache``, docs/cache.md) enters ``using(cache)``
(``memfit._trace_cache_scope``, which imports no torch) around its work; inside it,
``estimate`` looks its job up before tracing and stores what it traced. A plan traces a dozen steps; run again with the same model, batch and options, every
one of them is read back.

Note 1 (what is keyed, and what is not cached). The key names everything a trace reads: the
model's structure (each module's class and ``repr``, each parameter's and buffer's name,
shape, dtype, device, class, ``requires_grad`` and attached state; its config), the batch
(each tensor's shape and dtype, and the values of its integer and bool tensors, which a trace
reads: masks, labels), the optimizer's name, the device (a name, or a profile's every field),
the knobs and the other options, the versions of memfit's code (``_versions.code_version``:
every edit is a new key) and of the libraries it traces through, and the host's thread count
and instruction set (a CPU kernel's own buffers follow them). A job whose trace can read
what a key cannot name is traced every time: a model with weights (a router's values decide
its experts), one with hooks of its own, a user's step, loss, counter, scheduler or optimizer
instance.

Note 2 (what comes back). The ``Estimate`` is stored pickled, whole (its module records and
storage lifetimes with it). The cache folder is the user's own, written only by memfit; an
entry that does not unpickle is a miss.

Note 3 (block profiles: the twins, kept in the process). A deep model's estimate traces two
shallow twins (``api._blockwise``), and a twin does not depend on how many blocks the model has
(its config is a copy with the twin's depth, ``trace._block_twin``). So inside ``using(cache)``
each traced twin is also kept in memory under its own key (``key_for`` of the twin), beside the
cache it was entered with, and another estimate of the same blocks at another depth (``--what-if``'s
layer rows, a deeper config) composes from them without tracing. Kept in memory only, the last
``TWINS_KEPT``: a twin's trace holds its fake model and tracker, which do not pickle.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import weakref
from collections import OrderedDict

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit._cache import key_of
from memfit._trace_cache_scope import current, using
from memfit._versions import TRACED_LIBRARIES, code_version, library_version
from memfit.measure.attached import attached_tensors
from memfit.trace.compiled import compiled_regions

__all__ = ["using", "key_for", "lookup", "store", "twin_lookup", "twin_store"]

TWINS_KEPT = 8                   # traced twins kept per cache, in this process (Note 3)
_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # cache -> OrderedDict

_CALLABLES = ("loss_fn", "count_fn", "step", "scheduler")      # never keyed (Note 1)


def key_for(model, batch, optimizer, device, options: dict) -> str | None:
    """The cache key of this job, or None where it is not cached (Note 1)."""
    cache = current()
    if cache is None or not isinstance(optimizer, str) or not isinstance(model, nn.Module):
        return None
    if any(options.get(k) is not None for k in _CALLABLES):
        return None
    model_part = _model_part(model)
    batch_part = _batch_part(batch)
    if model_part is None or batch_part is None:
        return None
    return key_of(figure="estimate", model=model_part, compiled=_compiled_part(model),
                  batch=batch_part, optimizer=optimizer,
                  device=_plain(device), options=_plain({k: v for k, v in options.items()
                                                         if k not in _CALLABLES}),
                  code=code_version(), host=_host(),
                  libraries={name: library_version(name)
                             for name in ("torch", *TRACED_LIBRARIES)})


def _host() -> tuple:
    """The CPU a trace runs on, as far as a figure depends on it (Note 1): the kernels a CPU
    target's step runs hold buffers that follow the thread count and the instruction set
    (``measure._cpu_scratch``)."""
    return torch.get_num_threads(), torch.backends.cpu.get_cpu_capability()


def lookup(key: str | None):
    """The stored ``Estimate`` for ``key``, or None."""
    cache = current()
    if key is None or cache is None:
        return None
    data = cache.get(key)
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:           # Note 2: an entry of another layout is a miss
        return None


def store(key: str | None, est) -> None:
    cache = current()
    if key is not None and cache is not None:
        cache.put(key, pickle.dumps(est, protocol=pickle.HIGHEST_PROTOCOL))


def twin_lookup(key: str | None):
    """A twin traced under ``key`` in this process (Note 3), or None."""
    kept = _TWINS.get(current()) if key is not None and current() is not None else None
    if kept is None or key not in kept:
        return None
    kept.move_to_end(key)
    return kept[key]


def twin_store(key: str | None, traced) -> None:
    cache = current()
    if key is None or cache is None:
        return
    kept = _TWINS.setdefault(cache, OrderedDict())
    kept[key] = traced
    while len(kept) > TWINS_KEPT:
        kept.popitem(last=False)


def _model_part(model: nn.Module) -> dict | None:
    tensors = []
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or \
                getattr(m, "_backward_pre_hooks", None):
            return None                          # hooks of its own (Note 1)
        for kind, items in (("p", m._parameters), ("b", m._buffers)):
            for k, t in items.items():
                if t is None:
                    continue
                if t.device.type != "meta":
                    return None                  # weights whose values a trace may read
                extra = [(tuple(a.shape), str(a.dtype)) for a in attached_tensors(t)]
                tensors.append((name, kind, k, tuple(t.shape), str(t.dtype), type(t).__name__,
                                t.requires_grad, extra))
    config = getattr(model, "config", None)
    return {"modules": [(n, f"{type(m).__module__}.{type(m).__qualname__}", m.training)
                        for n, m in model.named_modules()],
            "repr": hashlib.sha256(repr(model).encode()).hexdigest(),
            "tensors": hashlib.sha256(repr(tensors).encode()).hexdigest(),
            "config": config.to_json_string(use_diff=False) if hasattr(config, "to_json_string")
            else None}


def _compiled_part(model: nn.Module) -> list | None:
    """How the model's regions are compiled, and what the partitioner reads
    (trace.compiled): another budget is another step."""
    regions = compiled_regions(model)
    if not regions:
        return None
    import torch._functorch.config as functorch_config

    return [[r.describe(), list(r.options)] for r in regions] + \
        [functorch_config.activation_memory_budget]


def _batch_part(batch) -> list | None:
    leaves, spec = tree_flatten(batch)
    out = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            values = None
            if x.device.type != "meta" and (x.dtype == torch.bool or not x.is_floating_point()):
                values = hashlib.sha256(x.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            out.append((tuple(x.shape), str(x.dtype), x.device.type, values))
        elif x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
        else:
            return None
    return out


def _plain(value):
    """``value`` as JSON: dataclasses by their fields, tuples as lists, the rest by repr."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
