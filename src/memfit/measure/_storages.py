"""The storages behind a tensor: its own, or a wrapper subclass's inner tensors' (DTensor)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["PLAIN", "storages_of"]


PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)   # no inner tensors of their own


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
    if t.layout is not torch.strided or (device_type is not None and t.device.type != device_type):
        return
    st = t.untyped_storage()
    if st.nbytes() > 0:
        yield st
