"""How remat holds its budget: every storage alive on the device counted from the session's
start (every tensor the garbage collector tracks, each leaf's ``.grad``; memfit's host tensors as
host memory), and on CUDA the allocator capped at the budget
(``set_per_process_memory_fraction``: it knows every byte)."""

from __future__ import annotations

import contextlib
import gc
import itertools

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.measure import Tracker, storages_of
from memfit.measure import _ledger as L

__all__ = ["count_live_storages", "cuda_fraction"]


def count_live_storages(tracker: Tracker) -> int:
    """Count in ``tracker`` every storage alive now on its device; return the device
    bytes this added."""
    ledger = tracker.ledger
    before = ledger.current_bytes
    gc.collect()              # garbage in cycles (e.g. a failed step's traceback) is not alive
    objects = gc.get_objects()
    kinds = {k for k in set(map(type, objects))
             if issubclass(k, torch.Tensor) or callable(getattr(k, "host_tensors", None))}
    found = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects
    for holder in found:                     # memfit's host memory first: not the device's
        if not isinstance(holder, torch.Tensor):
            for t in holder.host_tensors():
                for st in storages_of(t, ledger.device_type):
                    if ledger.sid(st) is None:
                        ledger.add(st, L.OPTIMIZER, entry=True, host=True)
    for t in found:
        if not isinstance(t, torch.Tensor) or isinstance(
                t, (FakeTensor, torch.nn.parameter.UninitializedTensorMixin)) or t.is_meta:
            continue
        grad = t.grad if t.is_leaf and t.requires_grad else None
        for x in (t,) if grad is None else (t, grad):
            for st in storages_of(x, ledger.device_type):
                if st.device.type != "meta" and ledger.sid(st) is None:
                    ledger.add(st, L.INPUTS, entry=True)
    return ledger.current_bytes - before


@contextlib.contextmanager
def cuda_fraction(budget: int):
    """The CUDA allocator refuses past ``budget`` bytes."""
    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).total_memory
    before = torch.cuda.get_per_process_memory_fraction(dev)
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, dev)
