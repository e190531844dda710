"""Buffers a collective's kernel makes and keeps: counted where they are born.

Note 1 (what the counting mode cannot see). A ``TorchDispatchMode`` sees an op, not the aten calls
inside its kernel: those are below the mode, which is off while its handler runs. A kernel's scratch
that dies inside it is rightly not counted, but a c10d collective's may outlive the op: gloo's
``_reduce_scatter_base_`` clones its whole input (the unsharded gradients of an FSDP2 group) and
keeps the clone in its ``Work`` until ``wait()`` splits it into the output. The counting mode first
saw that clone when ``wait`` read it, and took it for a storage alive since the region began:
``track`` around a step of a model sharded with ``fully_shard`` on gloo counted every group's clone
from the region's start, together the size of the unsharded gradients (on 2 ranks as large as
AdamW's state: +2,958,816 B per rank on a 6-layer decoder, as "inputs").

Note 2 (how they are seen). ``births`` runs a c10d op's backend kernel (``redispatch`` to its
CPU or CUDA key, below the Python key) under ``_Births``, a mode that only notes the storages
the kernel's own aten calls return on this thread, by weak reference. Those still alive when
the op returns are the collective's buffers: the counting mode counts them as born at that op
(temporaries), so their death is a death, not an entry storage leaving. Backends copy the
thread-local state (this mode included) to their worker threads; calls from another thread,
or after the op returned, pass through uncounted, as they did before. NCCL's scratch lies
outside the caching allocator and is not a tensor: nothing is noted there.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.measure._compile_aware import CompileAware

__all__ = ["births"]

_BACKEND_KEYS = {"cpu": torch._C.DispatchKey.CPU, "cuda": torch._C.DispatchKey.CUDA}


class _Births(CompileAware, TorchDispatchMode):
    """Notes the storages returned by the aten calls inside one collective (Note 2)."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()
        self.open = True
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.open and threading.get_ident() == self.thread:
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) and \
                        x.layout is torch.strided:
                    st = x.untyped_storage()
                    if st.nbytes() > 0:
                        self.refs.append(weakref.ref(st))
        return out


def births(func, args, kwargs) -> tuple[object, list]:
    """Run ``func``; for a c10d collective on CPU or CUDA tensors also return the storages its
    kernel made and kept (Note 2), else ``[]``."""
    key = _backend_key(func, args, kwargs)
    if key is None:
        return func(*args, **kwargs), []
    seen = _Births()
    try:
        with seen:
            out = func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
    finally:
        seen.open = False
    alive, keys = [], set()
    for ref in seen.refs:
        st = ref()
        if st is not None and st._cdata not in keys:
            keys.add(st._cdata)
            alive.append(st)
    return out, alive


def _backend_key(func, args, kwargs):
    if func.namespace != "c10d":
        return None
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if not tensors or any(type(x) not in (torch.Tensor, torch.nn.Parameter) for x in tensors):
        return None
    devices = {x.device.type for x in tensors}
    return _BACKEND_KEYS.get(devices.pop()) if len(devices) == 1 else None
