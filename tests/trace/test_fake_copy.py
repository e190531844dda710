"""trace.fake Note 1: a meta model's fake copy keeps each tensor's metadata and the sharing of
its storages. Oracle: the meta tensors themselves (shape, stride, offset, dtype, storage size,
which of them share a storage)."""

import torch
from torch import nn

from memfit.trace.fake import FakeCopier


class _Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.whole = nn.Parameter(torch.empty(6, 4, device="meta"))
        self.register_buffer("view", self.whole.detach()[2:].t())      # a view of its storage
        self.tail = nn.Parameter(torch.empty(20, device="meta")[5:])    # a slice of a larger one
        self.cl = nn.Parameter(torch.empty(2, 3, 4, 5, device="meta").to(
            memory_format=torch.channels_last))
        self.tied = self.whole


def _meta_of(t):
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
            t.untyped_storage().nbytes())


def test_every_tensor_and_every_shared_storage_is_kept():
    model = _Shared()
    fake = FakeCopier("cpu").module(model)
    names = ["whole", "view", "tail", "cl"]
    for n in names:
        assert _meta_of(getattr(fake, n)) == _meta_of(getattr(model, n)), n
        assert getattr(fake, n).device.type == "cpu"
    assert fake.tied is fake.whole
    storage = {n: getattr(fake, n).untyped_storage()._cdata for n in names}
    assert storage["view"] == storage["whole"]
    assert len({storage["whole"], storage["tail"], storage["cl"]}) == 3
