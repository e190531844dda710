"""The counting dispatch mode behind ``memfit.track``, and memfit's host-memory marker.

Note 1 (op boundaries). A ``TorchDispatchMode`` sees every aten op after autograd and composite
decomposition. After each op the storages it returned are counted; storages die through the ledger's
weak references to their ``UntypedStorage`` objects (PyTorch keeps that object for as long as the
C++ storage lives). Bytes a kernel allocates and frees inside itself are not visible at op
boundaries and are not counted, on any device.

Note 2 (budgets). With a budget, an op whose new storages would take the live bytes past it
has no effect: its outputs are dropped before anyone sees them, a random op's generator state
is restored, and an op that both writes its inputs and allocates has those inputs restored
from a copy taken before it ran (``Tracker.undo_on_oom``). Then ``memfit.OutOfMemory`` is
raised.

Note 3 (a trace inside a real run). Ops on fake tensors reach a real run's mode when a trace
runs inside ``track`` (``estimate``'s model copy, ops outside its fake mode). They hold no
bytes, run no kernel and are not the tracked program's: a real tracker lets them through
uncounted (no bytes, no op, no FLOPs, no budget), and the trace's own tracker, nested inside,
counts them (a ledger counts real storages or fake ones, never both).

Note 4 (memfit's host memory born before a region). ``host_allocations`` marks storages born
inside a tracked region. Host memory memfit made before it (an offloaded optimizer's twins,
made when a plan is applied; its state and the offload pool's buffers, kept from an earlier
step) would be first seen by a later tracker as an input, on the device: ``memfit.track()``
around ``trainer.train()`` after ``fit`` counted the twins against the budget. So every owner
of such memory registers itself (``register_host_owner``; it lives in a weak set, nothing is
kept alive); a tracker notes the storages of the live owners' ``host_tensors()`` when it opens,
and one of them first read in the region is counted as host memory (one that is never read is
not counted at all, as any storage born before the region).

Note 5 (the device query). PyTorch's C++ code asks a fake tensor its device through the
dispatcher (``prim.device``: a fake tensor reports a device it does not live on), about twice
per op a trace runs (10,290 of 16,220 dispatches in XLM-R large's fp16 step). Passed down, each
crossed every mode under this one to reach the fake mode's answer. The counter, on top of a
trace's modes, gives that answer itself (``fake_device``: ``fake_tensor._device_handler``'s, the
fake device, or meta while the fake mode runs a kernel); it allocates nothing and none of those
modes acts on it. The top mode of a trace's warm-up (``trace.fidelity``, by
``trace.finite_grads``) does the same.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from memfit.errors import OutOfMemory
from memfit.measure import _ledger as L
from memfit.measure._collectives import births
from memfit.measure._compile_aware import CompileAware
from memfit.measure._cpu_scratch import scratch_bytes
from memfit.measure._grad_sums import GradSums
from memfit.measure._leaves import leaves, tensors
from memfit.measure._sizes import hint

if TYPE_CHECKING:
    from memfit.measure.track import Tracker

__all__ = ["CountingMode", "fake_device", "count_first_reads", "host_allocations",
           "host_allocations_open", "allocates_and_writes", "written_args", "register_host_owner",
           "registered_host_tensors", "op_name"]

_aten = torch.ops.aten

# an op's name as its log and the composed step's checks spell it ("aten.mm.default"), made once
# per op: ``OpOverload.__str__`` formats it anew each call, for every op of every trace
op_name = functools.lru_cache(maxsize=None)(str)
_host = threading.local()
_host_owners: "weakref.WeakSet" = weakref.WeakSet()     # Note 4


@contextlib.contextmanager
def host_allocations():
    """Storages born inside count as host memory (memfit's own host pool), not the device.

    Offloading code wraps its host buffers and device-to-host copies in this, so that on a
    CPU-only machine, where "host" and "device" are the same memory, ``track`` and
    ``estimate`` still split the bytes as a GPU would.
    """
    depth = getattr(_host, "depth", 0)
    _host.depth = depth + 1
    try:
        yield
    finally:
        _host.depth = depth


def register_host_owner(owner) -> None:
    """``owner.host_tensors()`` are memfit's host memory for every tracker opened while
    ``owner`` lives (Note 4)."""
    _host_owners.add(owner)


def registered_host_tensors(fake: bool) -> list[torch.Tensor]:
    """The host tensors of every live registered owner (Note 4): the fake ones for a trace's
    tracker, the real ones for a real run's."""
    out = []
    for owner in list(_host_owners):
        out += [t for t in owner.host_tensors() if isinstance(t, FakeTensor) == fake]
    return out


def host_allocations_open() -> bool:
    """Whether this thread is inside ``host_allocations``."""
    return getattr(_host, "depth", 0) > 0


class CountingMode(CompileAware, TorchDispatchMode):
    """Counts the storages each op returns (and those it reads for the first time)."""

    def __init__(self, tracker: "Tracker"):
        super().__init__()
        self.t = tracker
        self.sums = GradSums()        # gradients autograd sums in place (measure._grad_sums)

    def __exit__(self, *exc):
        self.sums.close()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t = self.t
        kwargs = kwargs or {}
        if func is _DEVICE and isinstance(args[0], FakeTensor):                 # Note 5
            return fake_device(args[0])
        if func in _METADATA:    # queries that allocate nothing (asked often by fake tensors)
            return func(*args, **kwargs)
        flat_in = leaves((args, kwargs))
        ledger = t.ledger
        if not ledger.fake and any(isinstance(x, FakeTensor) for x in flat_in):
            return func(*args, **kwargs)              # Note 3
        if func not in _LIFT:
            count_first_reads(t, flat_in)
        t.ops += 1
        t.last_op = func
        scratch = scratch_bytes(func, args, kwargs)       # the kernel's own, while it runs
        held = ledger.transient(scratch) if scratch else None
        try:
            if t.budget_bytes is None:
                try:
                    out, kept = births(func, args, kwargs)   # with the buffers its kernel keeps
                except Exception as e:
                    t.note_failure(e, func)
                    raise
                self._count(func, args, kwargs, out, kept)
                return out
            with t.undo_on_oom(func, args):
                out, kept = births(func, args, kwargs)
                self._count(func, args, kwargs, out, kept)
            return out
        finally:
            if held is not None:
                ledger.end_transient(held)

    def _count(self, func, args, kwargs, out, kept=()):
        """``kept``: storages the op's kernel made and kept apart from its outputs (a
        collective's buffers, which ``_collectives.births`` notes): born here too."""
        t = self.t
        ledger = t.ledger
        new, resized = [], []
        for x in tensors(out):
            for st in ledger.storages(x):
                if ledger.sid(st) is None:
                    if all(st._cdata != s._cdata for s in new):
                        new.append(st)
                elif func in _RESIZING:
                    resized.append(st)
        for st in kept:
            if st.device.type == ledger.device_type and ledger.sid(st) is None and \
                    all(st._cdata != s._cdata for s in new):
                new.append(st)
        on_host = host_allocations_open()             # host memory: not under the budget
        requested = 0 if on_host else sum(hint(st.nbytes()) for st in new)
        requested += sum(max(0, ledger.growth(st)) for st in resized)
        if t.budget_bytes is not None and ledger.current_bytes + requested > t.budget_bytes:
            raise OutOfMemory(requested_bytes=requested, live_bytes=ledger.current_bytes,
                              budget_bytes=t.budget_bytes, op=str(func), module=t.watch.innermost)
        for st in resized:
            ledger.resize(st)
        for st in new:
            ledger.add(st, L.TEMPORARIES, entry=False, host=on_host)
        if t.labels is not None:
            t.labels.born(ledger, t.watch.stack, func, args, kwargs, out, new)
        backward = torch._C._current_graph_task_id() != -1
        old = self.sums.in_place_sum(func, args, kwargs, out, backward)
        if old is not None and len(new) == 1 and not on_host:
            merged = functools.partial(self._merged, t.online_peak_bytes)
            for st in ledger.storages(old):
                ledger.expect_in_place(st, new[0], merged)
        if ledger.current_bytes > t.online_peak_bytes:
            t.online_peak_bytes = ledger.current_bytes
        t.op_events.append(ledger.num_events)
        t.op_log.append(func)
        touched, fixed = _touched_bytes(ledger, args, kwargs, out)
        t.watch.touched(touched, backward)
        n = 0
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            n = hint(counter(*args, **kwargs, out_val=out))
            if backward:
                t.bw_flops += n
            else:
                t.fw_flops += n
            t.watch.flops(n, backward)
        t.op_costs.append((n, touched, fixed, requested))
        t.op_backward.append(backward)

    def _merged(self, peak_before: int, event: int, nbytes: int) -> None:
        """The last op's output was a gradient sum made in place (``Ledger.expect_in_place``): its
        birth event is gone, and so are the bytes it asked for and the online peak it set
        (``peak_before``: the peak before the op)."""
        t = self.t
        if t.op_events and t.op_events[-1] == event + 1:
            t.op_events[-1] = event
        n, touched, fixed, requested = t.op_costs[-1]
        t.op_costs[-1] = (n, touched, fixed, requested - nbytes)
        t.online_peak_bytes = max(peak_before, t.ledger.current_bytes)


_STATE = (L.PARAMS, L.GRADS, L.OPTIMIZER, L.OTHER)


def _touched_bytes(ledger, args, kwargs, out) -> tuple[int, int]:
    """Bytes an op reads and writes, as a kernel would: its tensor arguments and results
    (views count their own extent, not their whole storage), and the part of them that is
    training state (parameters, gradients, optimizer state, buffers), whose size does not
    depend on the batch. A time model's bandwidth term."""
    total = fixed = 0
    for x in tensors((args, kwargs)):
        n = hint(x.numel()) * x.element_size()
        total += n
        if any(ledger.category_of(st) in _STATE for st in ledger.storages(x)):
            fixed += n
    for x in tensors(out):
        total += hint(x.numel()) * x.element_size()
    return total, fixed


# ``torch.tensor(data)`` builds its tensor outside the dispatcher, then lifts it: the lift's
# input is born here, not alive since the start, so it is counted as the lift's output.
_LIFT = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default, _aten.lift.default}

_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
_METADATA = {_DEVICE, _aten.sym_size.int, _aten.sym_stride.int,
             _aten.sym_numel.default, _aten.sym_storage_offset.default,
             _aten.is_contiguous.default, _aten.is_contiguous.memory_format}

_RESIZING = {_aten.resize_.default, _aten.set_.source_Storage, _aten.set_.source_Tensor,
             _aten.set_.source_Storage_storage_offset}


def count_first_reads(t: "Tracker", flat) -> None:
    """Count each storage of the tensors in ``flat`` that ``t`` has not seen yet: born before the
    region, it is an input from the region's start (Note 4 for memfit's host memory)."""
    ledger = t.ledger
    for x in flat:
        if isinstance(x, torch.Tensor):
            for st in ledger.storages(x):
                if ledger.sid(st) is None:
                    ledger.add(st, L.INPUTS, entry=True, host=st._cdata in t.host_before)


def fake_device(x: FakeTensor) -> torch.device:
    """The answer to ``prim.device`` on a fake tensor, as the fake mode gives it (Note 5)."""
    return _META if x.fake_mode.in_kernel_invocation else x.fake_device


def allocates_and_writes(func) -> bool:
    schema = func._schema
    if not schema.is_mutable:
        return False
    return any(r.alias_info is None for r in schema.returns)


def written_args(func, args) -> list[torch.Tensor]:
    out = []
    for a, x in zip(func._schema.arguments, args):
        if a.alias_info is not None and a.alias_info.is_write and isinstance(x, torch.Tensor):
            out.append(x)
    return out
