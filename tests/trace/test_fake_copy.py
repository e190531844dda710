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


def test_the_copy_is_a_deep_copy_of_every_container_and_hook():
    """Note 4: a module's own dicts and sets are copied into the memo first; the copy is still
    ``copy.deepcopy``'s: new containers, the same keys in order, hooks kept, sharing kept."""
    import copy
    from collections import OrderedDict

    model = nn.Sequential(_Shared(), nn.Linear(4, 4, device="meta"))
    model[0].register_buffer("scratch", torch.empty(3, device="meta"), persistent=False)
    seen = []
    model[1].register_forward_hook(lambda m, i, o: seen.append(1))
    model[0].shared_dict = model[1]._parameters                # another reference to one dict
    fake = FakeCopier("cpu").module(model)
    plain = copy.deepcopy(model)                               # what it must equal in form
    for mine, theirs, orig in zip(fake.modules(), plain.modules(), model.modules()):
        for name, value in vars(orig).items():
            if type(value) in (OrderedDict, set, dict):
                copied = vars(mine)[name]
                assert copied is not value and type(copied) is type(value), name
                assert list(copied) == list(vars(theirs)[name]), name
    assert fake[0].shared_dict is fake[1]._parameters         # sharing kept
    assert "scratch" in fake[0]._non_persistent_buffers_set
    assert fake[0]._non_persistent_buffers_set is not model[0]._non_persistent_buffers_set
    assert list(fake[1]._forward_hooks.values()) == list(model[1]._forward_hooks.values())
    assert fake[1].weight is not model[1].weight and fake[1].weight.device.type == "cpu"
