"""The storages behind a tensor: its own, or a wrapper subclass's inner tensors' (DTensor).

Note 1 (read past the torch-function modes). A trace runs under several torch-function modes
(memfit's models of CUDA's kernels and autocast, the fake deepcopy), and each of them is called
for every tensor attribute Python reads outside an op: a tensor's layout, device and storage
cost 11 us under four modes and 1.6 us without (measured). The bookkeeping between ops (a
tracker registering the parameters, gradients and optimizer state, the labels of each block's
storages) reads them thousands of times a trace, so the reads are made with the modes off
(``with NO_MODES():``): a mode models what the user's code calls, not what memfit reads. Only
a tensor without inner tensors is read so: a wrapper subclass's attributes are its own to give.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["NO_MODES", "PLAIN", "storages_of"]


PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)   # no inner tensors of their own
NO_MODES = torch._C.DisableTorchFunction     # a fresh one each time: it keeps what it ended


def storages_of(t: torch.Tensor, device_type: str | None = None):
    """The non-empty untyped storages behind ``t`` (the inner tensors of a wrapper subclass,
    e.g. DTensor), only those of tensors on ``device_type`` when it is given.

    The device is the tensor's: a fake tensor reports the device it stands for, while its
    storage is a ``meta`` one.
    """
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and not isinstance(t, torch._subclasses.FakeTensor):
        names, _ = flatten()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):   # DTensor also lists its device_mesh
                yield from storages_of(inner, device_type)
        return
    with NO_MODES():                              # Note 1
        if t.layout is not torch.strided or (device_type is not None and
                                             t.device.type != device_type):
            return
        st = t.untyped_storage()
    if st.nbytes() > 0:
        yield st
