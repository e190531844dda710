"""An optimizer that steps each parameter by itself, traced once per kind of parameter.

Note 1 (why and what). memfit's low-bit optimizers update one parameter at a time
(torchao's step unrolled, ``techniques._torchao_optimizer``: about 130 ops a parameter; the
8-bit step of bitsandbytes, ``techniques._bnb_optimizer``), and a transformer's parameters come
in a few kinds (a block's 16 are 5 shapes, repeated in every block). At the steady state an
update allocates only temporaries, freed before it returns, and writes the parameter and its
state in place, so what it adds to the trace depends only on the metadata of what it reads:
the parameter, its gradient, its state and the settings of its group. ``once_per_kind`` wraps
such an update: inside ``repeats_allowed`` (a fake trace of the optimizer phase alone,
``api._traced``), the first call of each kind runs and is recorded, and every later call of
that kind appends a copy of the recorded ops and events (``measure._repeats``) instead of
running: the same timeline, peak, breakdown and op costs, event by event
(tests/trace/test_per_parameter.py holds every figure to the trace that runs every update).
A call whose stretch is not closed (the first step making state, a storage first read there)
is not recorded, and the next call of its kind runs. Outside ``repeats_allowed``, and in a
real run always, every call runs. In a twin's trace, whose tracker labels storages by block
(``trace.block_reuse``), the copy's ops take the block of the parameter it reads: the storages
each call reads go with it (``measure._repeats``, on block labels).

Note 2 (the kind). The key is the metadata of every tensor the update reads (type, shape,
stride, offset, dtype, device, storage size; a tensor subclass by its inner tensors and
context), and the value of everything else: numbers, strings and flags as they are, an
object by its identity. A group's ``params`` list is left out (it names every parameter of
the group, the same for each of them). The caller passes what the update reads, settings
resolved (bitsandbytes' per-parameter overrides by ``get_config``).

Note 3 (across the twins). The two shallow twins of a composed step (``api._blockwise``) are
traced with the same knobs, device model and optimizer settings, and hold the same kinds of
parameter, so twin B's updates are twin A's: inside ``kinds_shared`` a stretch recorded in one
trace is repeated in the other, and twin B runs no update it shares a kind with (the 4-bit
phase of XLM-R large: 20 updates run before, 10 now). A copy goes to another tracker only where
nothing in it names a storage of the tracker it was recorded in beyond the call's own reads and
births (``measure._repeats.repeat`` refuses it, and the update runs and is recorded anew), and
only where its kind names no object by identity (such a kind is keyed by its trace too: an
object of one trace may have died and its id been reused by another).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.measure._repeats import opening, recorded, repeat
from memfit.measure.track import active_tracker

__all__ = ["repeats_allowed", "kinds_shared", "once_per_kind"]

_memos: list[dict] = []           # one per ``repeats_allowed`` region, innermost last
_shared: list[dict] = []          # one per ``kinds_shared`` scope, innermost last


@contextlib.contextmanager
def repeats_allowed():
    """Let ``once_per_kind`` updates repeat their kind's recorded stretch (Note 1), the
    stretches of the innermost ``kinds_shared`` scope among them (Note 3)."""
    _memos.append(_shared[-1] if _shared else {})
    try:
        yield
    finally:
        _memos.pop()


@contextlib.contextmanager
def kinds_shared():
    """Let the traces inside (the two twins of one step, traced alike) repeat each other's
    recorded stretches (Note 3)."""
    _shared.append({})
    try:
        yield
    finally:
        _shared.pop()


def once_per_kind(reads):
    """Decorate a per-parameter update ``method(self, *args)`` that returns None; ``reads(self,
    *args)``: what it reads (Note 2)."""
    def wrap(method):
        @functools.wraps(method)
        def update(self, *args):
            tracker = active_tracker(fake=True)
            if not _memos or tracker is None:
                return method(self, *args)
            memo = _memos[-1]
            what = reads(self, *args)
            objects: list = []
            key = (type(self), method.__name__, _kind(what, objects))
            if objects:          # an object by its identity: this trace's only (Note 3)
                key += (id(tracker),)
            stretch = memo.get(key)
            sids = _read_sids(tracker.ledger, what)
            if stretch is not None and sids is not None and repeat(tracker, stretch, sids):
                return None
            mark = opening(tracker)
            out = method(self, *args)
            if out is None and sids is not None and \
                    (stretch := recorded(tracker, mark, sids)) is not None:
                memo[key] = stretch
            return out
        return update
    return wrap


def _read_sids(ledger, what) -> tuple[int, ...] | None:
    """The ledger's ids of the storages of every tensor in ``what``, in order (Note 1); None
    where one is not counted yet (running the call would count it first)."""
    out = []
    for t in _tensors(what):
        for st in ledger.storages(t):
            sid = ledger.sid(st)
            if sid is None:
                return None
            out.append(sid)
    return tuple(out)


def _entries(d: dict):
    """A dict's entries but a group's ``params`` list (Note 2)."""
    return ((k, v) for k, v in d.items() if k != "params")


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for _, v in _entries(x):
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _kind(x, objects: list):
    """A hashable description of ``x`` (Note 2); each object described by its identity is
    appended to ``objects``."""
    if isinstance(x, torch.Tensor):
        flatten = getattr(x, "__tensor_flatten__", None)
        if flatten is not None and not isinstance(x, FakeTensor):
            names, ctx = flatten()
            return (type(x), tuple(x.shape), x.dtype, _kind(ctx, objects),
                    tuple((n, _kind(getattr(x, n), objects)) for n in names))
        return (type(x), tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device,
                x.requires_grad, x.untyped_storage().nbytes())
    if isinstance(x, dict):
        return ("dict", tuple((k, _kind(v, objects)) for k, v in _entries(x)))
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_kind(v, objects) for v in x))
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return x
    objects.append(x)
    return (type(x), id(x))
