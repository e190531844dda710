"""The ledger: every storage that is live during a tracked region, as an event log.

Note 1 (what is counted). A *storage* is counted once, however many tensors view it, from the
moment an op returns it (or, for a storage that was alive before the region, from the start of
the region) until the storage dies. Death is observed through a weak reference to the
``UntypedStorage`` object: PyTorch preserves that Python object for as long as the C++ storage
lives (autograd's saved variables included), so the callback fires exactly when the bytes are
released. Fake and meta storages behave the same way, which is what lets ``estimate`` and
``track`` share this one counter.

Note 2 (why an event log). Categories are only known late (a temporary becomes ``p.grad``; a
state tensor is recognised after ``optimizer.step``), and tensors alive before the region may
be discovered only when an op first reads them. So the ledger records events (+bytes at
birth, -bytes at death) and resolves the timeline, the peak and the breakdown at the peak
afterwards, with every storage's final category and entry storages counted from the start.

Note 3 (real or fake). A ledger counts one kind of storage: a real run's (``fake=False``), or
a trace's (``fake=True``: fake tensors, whose storages are ``meta`` ones). A trace run inside
a real ``track`` (``estimate`` inside ``track(budget=...)``) holds no bytes, so the real
ledger must not count it, and the trace's own ledger, nested inside, counts it alone.

Note 4 (placement that the trace's device cannot show). A trace runs on the CPU, where host
and device are one memory; what a GPU would hold elsewhere is told to the ledger. A storage
marked host (``set_host``, or ``add(host=True)``) is host memory over its whole life;
``move_to_host`` ends a storage's device life at that event and starts a host twin (another
id, the same storage) that lives until the storage dies (FSDP2's gradients under CPU offload:
reduce-scattered on the device, then copied to the host); ``transient`` / ``end_transient``
record a device buffer that no tensor of the trace stands for (the device copy of a host
shard a GPU makes before the all-gather, which on the CPU is the shard itself). A storage marked
unified (``set_unified``: bitsandbytes' paged optimizer state, ``cudaMallocManaged``) is off the
device's allocator and out of the host figure alike: the caller counts it on the card apart.

Note 5 (symbolic sizes). In a trace shared by several batch shapes (``api._shared_shapes``) a
storage's size is a ``SymInt``. The ledger counts its value in the traced shape, as any trace
does, and also keeps its expression per event, so that ``device_events(value)`` gives the same
event log in another shape; the structure of the log (which storage is born and dies when) is
the traced one, which the shared trace's guards ensure holds for that shape.

Note 6 (a sum autograd makes in place). Where the engine's ``old + new`` would have been
``old.add_(new)`` in a run without a dispatch mode (``measure._grad_sums``), the counter names
the two storages (``expect_in_place``) right after the sum's birth. If ``old`` dies next, before
any other event (nothing else held it), the sum's birth and ``old``'s death are taken back and
the sum's storage goes on as ``old``'s id: ``old``'s bytes live until the sum dies, as the
in-place add keeps them. ``on_merge`` tells the counter, which moves its per-op marks back.

Note 7 (a first step made, not traced). A GPU replay needs the step before the counted one.
``trace.first_step`` may make it from the counted step (``first``: ``measure._first_step_log``);
its events then come before the log in ``device_events``, and the storages it makes leave the
entries there. Optimizer state older than the first step (``first.late``: bitsandbytes' maps)
comes last among the entries: a traced first step finds it only when its optimizer step reads
it, after everything the forward and backward read. The ledger's own events, ``resolve`` and
every figure of the counted step are unchanged.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from memfit.measure._first_step_log import FirstStep
from memfit.measure._resolved import (ACTIVATIONS, CATEGORIES, GRADS, INPUTS, OPTIMIZER,
                                      OTHER, PARAMS, TEMPORARIES, Resolved)
from memfit.measure._sizes import expr as _expr
from memfit.measure._storages import NO_MODES as _NO_MODES
from memfit.measure._storages import PLAIN as _PLAIN
from memfit.measure._storages import storages_of
from memfit.measure._sizes import hint as _hint

__all__ = ["Ledger", "Resolved", "storages_of", "CATEGORIES", "PARAMS", "GRADS", "OPTIMIZER",
           "OTHER", "INPUTS", "ACTIVATIONS", "TEMPORARIES"]  # the categories: measure._resolved


class Ledger:
    """Registers storages, records their births and deaths, and resolves the timeline."""

    def __init__(self, device_type: str, fake: bool = False):
        self.device_type = device_type
        self.fake = fake                # counts fake (meta) storages, else real ones (Note 3)
        self.current_bytes = 0          # live bytes known so far (online; for budgets)
        self._sid_of: dict[int, int] = {}   # storage C pointer -> storage id
        self._nbytes: list[int] = []        # per storage id
        self._category: list[int] = []      # per storage id
        self._refs: list[weakref.ref | None] = []
        self._ptr: list[int] = []           # per storage id: its address (0 for a fake one)
        self._entry: dict[int, int] = {}    # storage id alive before the region -> its bytes then
        self._ev_sid: list[int] = []        # event log: storage id
        self._ev_delta: list[int] = []      # event log: +bytes at birth, -bytes at death
        self._host: set[int] = set()        # storage ids that live off the device's allocator
        self._unified: set[int] = set()     # ...of which unified memory, not host (Note 4)
        self._resizes: set[int] = set()     # event indices that are in-place resizes
        self._moved: dict[int, int] = {}    # storage id -> its id after a move to the host
        # symbolic sizes (Note 5): storage id -> its size's expression now, and at entry; event
        # index -> its +/- bytes' expression
        self._size_expr: dict[int, object] = {}
        self._entry_expr: dict[int, object] = {}
        self._ev_expr: dict[int, object] = {}
        self._alias: dict[int, int] = {}    # a sum's storage id -> the id it goes on as (Note 6)
        self._pending: tuple | None = None  # (old id, sum id, sum's key, its birth, on_merge)
        self.first = FirstStep()            # a first step made, not traced (Note 7)
        self.open = True

    # -- registration -----------------------------------------------------------------------
    def storages(self, t: torch.Tensor):
        """The storages of ``t`` this ledger counts: on its device, real or fake (Note 3)."""
        if type(t) in _PLAIN:        # one storage at most: ``storages_of`` without its walk
            with _NO_MODES():        # measure._storages says why
                if t.layout is not torch.strided or t.device.type != self.device_type:
                    return ()
                st = t.untyped_storage()
            return (st,) if st.nbytes() > 0 and (st.device.type == "meta") == self.fake else ()
        return [st for st in storages_of(t, self.device_type)
                if (st.device.type == "meta") == self.fake]

    def sid(self, storage) -> int | None:
        return self._sid_of.get(storage._cdata)

    def add(self, storage, category: int, *, entry: bool, host: bool = False) -> int:
        """Start counting ``storage``: born now, or (``entry``) alive since the region began;
        ``host``: it lives in host memory (counted apart from the device)."""
        key = storage._cdata
        sid = len(self._nbytes)
        nbytes = storage.nbytes()
        if (e := _expr(nbytes)) is not None:
            self._size_expr[sid] = e
            nbytes = _hint(nbytes)
        self._sid_of[key] = sid
        self._nbytes.append(nbytes)
        self._category.append(category)
        self._ptr.append(0 if self.fake else storage.data_ptr())
        self._refs.append(weakref.ref(storage, lambda _, sid=sid, key=key: self._died(sid, key)))
        if host:
            self._host.add(sid)
        else:
            self.current_bytes += nbytes
        if entry:
            self._entry[sid] = nbytes
            if e is not None:
                self._entry_expr[sid] = e
        else:
            self._log(sid, nbytes, e)
        return sid

    def _log(self, sid: int, delta: int, delta_expr=None) -> None:
        self._pending = None
        if delta_expr is not None:
            self._ev_expr[len(self._ev_delta)] = delta_expr
        self._ev_sid.append(sid)
        self._ev_delta.append(delta)

    def _death_expr(self, sid: int):
        e = self._size_expr.get(sid)
        return None if e is None else -e

    def mark(self, storage, category: int) -> None:
        sid = self._sid_of.get(storage._cdata)
        if sid is not None and category < self._category[sid]:
            self._category[sid] = category

    def mark_tensor(self, t, category: int, *, entry: bool = False) -> None:
        """Mark every storage of ``t``, registering it first (as entry-alive if ``entry``)."""
        if not isinstance(t, torch.Tensor):
            return
        for st in self.storages(t):
            if self.sid(st) is None:
                self.add(st, category, entry=entry)
            else:
                self.mark(st, category)

    def growth(self, storage) -> int:
        """Bytes a counted storage has grown by since it was last recorded (resize_)."""
        sid = self._sid_of.get(storage._cdata)
        return 0 if sid is None or sid in self._host else \
            _hint(storage.nbytes()) - self._nbytes[sid]

    def resize(self, storage) -> None:
        """A storage changed size in place (``resize_``/``set_``): record the difference."""
        sid = self._sid_of.get(storage._cdata)
        if sid is None:
            return
        new = storage.nbytes()
        delta = _hint(new) - self._nbytes[sid]
        new_expr, old_expr = _expr(new), self._size_expr.get(sid)
        if delta or new_expr != old_expr:
            self._nbytes[sid] += delta
            if sid not in self._host:
                self.current_bytes += delta
            self._resizes.add(len(self._ev_delta))
            delta_expr = None
            if new_expr is not None or old_expr is not None:
                self._size_expr[sid] = new if new_expr is None else new_expr
                delta_expr = self._size_expr[sid] - (self._nbytes[sid] - delta
                                                     if old_expr is None else old_expr)
            self._log(sid, delta, delta_expr)

    def expect_in_place(self, old, total, on_merge) -> None:
        """``total`` (just born) is the engine's sum of ``old`` and a new gradient, which a run
        without a mode makes in place if ``old`` dies next (Note 6)."""
        o, s = self.sid(old), self.sid(total)
        if o is None or s is None or o in self._host or s in self._host or \
                not self._ev_sid or self._ev_sid[-1] != s or self._ev_delta[-1] <= 0:
            return
        self._pending = (o, s, total._cdata, len(self._ev_delta) - 1, on_merge)

    def _merge(self, key: int) -> None:
        """Note 6: the sum goes on as ``old`` (whose storage, ``key``, just died)."""
        old, total, total_key, event, on_merge = self._pending
        self._pending = None
        self._ev_sid.pop()
        self._ev_delta.pop()
        self._ev_expr.pop(event, None)
        self.current_bytes -= self._nbytes[total]
        self._alias[total] = old
        self._category[old] = min(self._category[old], self._category[total])
        if self._sid_of.get(key) == old:
            del self._sid_of[key]
        self._sid_of[total_key] = old
        on_merge(event, self._nbytes[total])

    def _died(self, sid: int, key: int) -> None:
        if not self.open:
            return
        while sid in self._alias:       # a sum that went on as another id (Note 6)
            sid = self._alias[sid]
        p = self._pending
        if p is not None and p[0] == sid and p[3] == len(self._ev_delta) - 1:
            self._merge(key)
            return
        while sid in self._moved:       # moved to the host: the host copy dies (Note 4)
            sid = self._moved[sid]
        if self._sid_of.get(key) == sid:
            del self._sid_of[key]
        if sid not in self._host:
            self.current_bytes -= self._nbytes[sid]
        self._log(sid, -self._nbytes[sid], self._death_expr(sid))

    def close(self) -> None:
        """Stop listening for deaths (storages that outlive the region stay counted live)."""
        self.open = False

    # -- queries ----------------------------------------------------------------------------
    @property
    def num_events(self) -> int:
        return len(self._ev_delta)

    def category_of(self, storage) -> int | None:
        sid = self._sid_of.get(storage._cdata)
        return None if sid is None else self._category[sid]

    def categories(self) -> list[int]:
        """The final category of every storage id (Note 2), indexed by id; a copy."""
        return list(self._category)

    def address_events(self) -> list[tuple[int, int]]:
        """(address, +/- bytes) of the region's births and deaths in order, host storages
        included (an independent allocator log can be matched against it, block for block)."""
        return [(self._ptr[s], d) for s, d in zip(self._ev_sid, self._ev_delta)]

    def nbytes_of_sid(self, sid: int) -> int:
        return self._nbytes[sid]

    def set_host(self, storage) -> None:
        """From now on ``storage`` is host memory (e.g. a CUDA optimizer's CPU step counter)."""
        sid = self._sid_of.get(storage._cdata)
        if sid is not None and sid not in self._host:
            self._host.add(sid)
            self.current_bytes -= self._nbytes[sid]

    def set_unified(self, storage) -> None:
        """``storage`` lives in unified memory over its whole life (Note 4)."""
        sid = self._sid_of.get(storage._cdata)
        if sid is not None:
            self.set_host(storage)
            self._unified.add(sid)

    def move_to_host(self, storage) -> None:
        """``storage`` leaves the device now and lives on the host from here on (Note 4)."""
        key = storage._cdata
        sid = self._sid_of.get(key)
        if sid is None or sid in self._host:
            return
        nbytes = self._nbytes[sid]
        self._log(sid, -nbytes, self._death_expr(sid))   # the device bytes die here...
        self.current_bytes -= nbytes
        new = len(self._nbytes)                   # ...and a host twin is born
        self._sid_of[key] = new
        self._nbytes.append(nbytes)
        if sid in self._size_expr:
            self._size_expr[new] = self._size_expr[sid]
        self._category.append(self._category[sid])
        self._ptr.append(self._ptr[sid])
        self._refs.append(None)                   # the first id's reference reports the death
        self._host.add(new)
        self._moved[sid] = new
        self._log(new, nbytes, self._size_expr.get(new))

    def transient(self, nbytes: int, category: int = TEMPORARIES) -> int:
        """A device buffer no tensor of the trace stands for (Note 4): born now; returns the
        id ``end_transient`` takes."""
        sid = len(self._nbytes)
        if (e := _expr(nbytes)) is not None:
            self._size_expr[sid] = e
            nbytes = _hint(nbytes)
        self._nbytes.append(nbytes)
        self._category.append(category)
        self._ptr.append(0)
        self._refs.append(None)
        self._log(sid, nbytes, e)
        self.current_bytes += nbytes
        return sid

    def end_transient(self, sid: int) -> None:
        self._log(sid, -self._nbytes[sid], self._death_expr(sid))
        self.current_bytes -= self._nbytes[sid]

    def is_host(self, storage) -> bool:
        sid = self._sid_of.get(storage._cdata)
        return sid is not None and sid in self._host

    @property
    def symbolic(self) -> bool:
        """Whether some storage's size is symbolic (Note 5)."""
        return bool(self._size_expr)

    def size_exprs(self) -> set:
        """Every expression ``device_events(value)`` asks ``value`` for (Note 5)."""
        return set(self._entry_expr.values()) | set(self._ev_expr.values())

    def device_events(self, value=None) -> list[tuple[int, int, int, bool]]:
        """(log index or -1 for an entry storage, storage id, +/- bytes, is an in-place
        resize) on the device: entry storages first (their size on entry), then the log; with
        a first step made (Note 7), its events come before the log and every index after them
        is shifted by their number (``first.length``).
        ``value(expr) -> int``: the bytes in another shape of a symbolic trace (Note 5)."""
        if value is None:
            entry, log = self._entry, self._ev_delta
        else:
            entry = {sid: value(self._entry_expr[sid]) if sid in self._entry_expr else n
                     for sid, n in self._entry.items()}
            log = [value(self._ev_expr[i]) if i in self._ev_expr else d
                   for i, d in enumerate(self._ev_delta)]
        made, late = (self.first.made.keys() | self.first.grads.keys(), self.first.late) \
            if self.first.events is not None else ((), ())
        out = [(-1, sid, n, False) for sid, n in entry.items()
               if sid not in self._host and sid not in made and sid not in late]
        out += [(-1, sid, entry[sid], False) for sid in entry if sid in late and
                sid not in self._host]
        shift = self.first.length          # Note 7: the first step made, before the log
        if shift:
            if value is not None:
                raise ValueError("a first step made from the counted one has no other shape")
            out += [(i, s, d, r) for i, (s, d, r) in enumerate(self.first.events)
                    if s not in self._host]
        out += [(shift + i, s, d, i in self._resizes)
                for i, (s, d) in enumerate(zip(self._ev_sid, log))
                if s not in self._host]
        return out

    def add_unseen(self, nbytes: int, category: int, *, host: bool = False,
                   unified: bool = False) -> int:
        """A new storage id no storage object stands for (one a composed or repeated stretch,
        or a first step made from the counted one, Note 7, makes); no event is logged."""
        sid = len(self._nbytes)
        self._nbytes.append(nbytes)
        self._category.append(category)
        self._ptr.append(0)
        self._refs.append(None)
        if host:
            self._host.add(sid)
        if unified:
            self._unified.add(sid)
        return sid


    def resolve(self, window_start: int = 0) -> Resolved:
        ncat = len(CATEGORIES)
        cats = np.asarray(self._category, dtype=np.int64)
        host = np.zeros(len(self._nbytes), dtype=bool)
        host[list(self._host)] = True
        pool = host.copy()                         # host memory, unified memory left out
        pool[list(self._unified)] = False
        base_by_cat = np.zeros(ncat, dtype=np.int64)
        host_base = 0
        for sid, nbytes in self._entry.items():
            if pool[sid]:
                host_base += nbytes
            elif not host[sid]:                    # unified memory: neither (Note 4)
                base_by_cat[cats[sid]] += nbytes
        sids = np.asarray(self._ev_sid, dtype=np.int64)
        deltas = np.asarray(self._ev_delta, dtype=np.int64)
        on_host = host[sids] if len(sids) else np.zeros(0, dtype=bool)
        dev = np.where(on_host, 0, deltas)
        per_cat = np.zeros((len(deltas), ncat), dtype=np.int64)
        if len(deltas):
            per_cat[np.arange(len(deltas)), cats[sids]] = dev
        by_cat = base_by_cat + np.cumsum(per_cat, axis=0)
        base = int(base_by_cat.sum())
        series = base + np.cumsum(dev)
        in_pool = pool[sids] if len(sids) else np.zeros(0, dtype=bool)
        host_series = host_base + np.cumsum(np.where(in_pool, deltas, 0))
        host_peak = max([host_base] + ([int(host_series.max())] if len(host_series) else []))
        before = base if window_start <= 0 else int(series[window_start - 1])
        window = series[window_start:]
        if len(window) and window.max() > before:
            peak_event = window_start + int(window.argmax())
            peak = int(series[peak_event])
        else:
            peak_event, peak = window_start - 1, before
        return Resolved(series, by_cat, base, base_by_cat, peak, peak_event, host_peak, window_start)
