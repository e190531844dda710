"""``LiveBytes``: an oracle for device bytes that is not memfit's counter.

A dispatch mode written for the tests: every CPU storage an op reads or returns is counted from
the first time it is seen until it dies (a weak finalizer); the peak is over the region. A
tensor subclass that wraps others (torchao's ``NF4Tensor``) is counted by the tensors it wraps. Storages
memfit puts in host memory (born inside ``host_allocations``, or given as ``host_tensors``) are
kept apart (``host_bytes``, ``host_peak_bytes``). ``device_tensors`` are counted from the start,
as alive before the region opens.

``job_tensors(before)`` finds what a job holds between steps without asking memfit: every CPU
tensor the garbage collector can reach whose storage was not alive at ``before``
(``alive_storages()`` taken before the job was built): the weights, the state a quantized
weight keeps beside it, the optimizer's state, the batch.
"""

import gc
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from memfit.measure._counting import host_allocations_open


class LiveBytes(TorchDispatchMode):
    """Live CPU storage bytes over a region and their peak; host ones apart."""

    def __init__(self, host_tensors=(), device_tensors=()):
        super().__init__()
        self.live: dict[int, tuple[int, bool]] = {}
        self.device_bytes = self.peak_bytes = 0
        self.host_bytes = self.host_peak_bytes = 0
        for t in host_tensors:
            self._see(t.untyped_storage(), host=True)
        for t in device_tensors:
            self._see(t.untyped_storage(), host=False)

    def _see(self, st, host: bool) -> None:
        key = st._cdata
        if key in self.live:
            return
        self.live[key] = (st.nbytes(), host)
        if not host:
            self.device_bytes += st.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.device_bytes)
        else:
            self.host_bytes += st.nbytes()
            self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        weakref.finalize(st, self._gone, key)

    def _gone(self, key: int) -> None:
        nbytes, host = self.live.pop(key)
        if not host:
            self.device_bytes -= nbytes
        else:
            self.host_bytes -= nbytes

    def _count(self, tree) -> None:
        for x in tree_leaves(tree):
            if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) and \
                    x.device.type == "cpu":
                for st in _storages(x):
                    self._see(st, host_allocations_open())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._count((args, kwargs))
        out = func(*args, **(kwargs or {}))
        self._count(out)
        return out


def _storages(x: torch.Tensor):
    """The storages holding ``x``'s data: a wrapper subclass's (torchao's ``NF4Tensor``) are
    its inner tensors', its own is a size with no memory behind it."""
    if is_traceable_wrapper_subclass(x):
        for name in x.__tensor_flatten__()[0]:
            yield from _storages(getattr(x, name))
    else:
        yield x.untyped_storage()


def _cpu_tensors():
    gc.collect()
    for t in gc.get_objects():
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and \
                t.device.type == "cpu" and t.layout is torch.strided and not t.is_meta and \
                not is_traceable_wrapper_subclass(t):     # its inner tensors are found too
            yield t


def alive_storages() -> set[int]:
    """The CPU storages alive now (their ``_cdata``)."""
    return {t.untyped_storage()._cdata for t in _cpu_tensors()}


def job_tensors(before: set[int]) -> list[torch.Tensor]:
    """One tensor per CPU storage alive now and not in ``before`` (the module note)."""
    out: dict[int, torch.Tensor] = {}
    for t in _cpu_tensors():
        key = t.untyped_storage()._cdata
        if key not in before:
            out.setdefault(key, t)
    return list(out.values())
