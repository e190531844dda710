"""``UntypedStorage.resize_`` (FSDP2's free and re-allocation of unsharded parameters) is
counted by ``track`` (measure._storage_resize Note 1), and the wrapper exists only while a
tracker runs. Oracle: the bytes by hand."""

import torch

import memfit


def test_a_storage_resized_to_zero_is_freed():
    x = torch.zeros(1000)                       # 4000 B, alive before the region (an input)
    with memfit.track() as t:
        y = x * 2                               # x + y: 8000 B
        x.untyped_storage().resize_(0)          # x freed without an aten op: 4000 B
        z = torch.zeros(1000)                   # y + z: 8000 B (12000 if the free were missed)
    assert t.peak_bytes == 2 * 4000
    assert y.numel() == z.numel() == 1000


def test_a_storage_grown_in_place_is_counted():
    with memfit.track() as t:
        a = torch.empty(0)                      # no bytes: nothing to count yet
        a.untyped_storage().resize_(4000)       # now 4000 B, without an aten op
    assert t.peak_bytes == 4000 and a.untyped_storage().nbytes() == 4000


def test_the_wrapper_is_there_only_inside_a_region():
    before = torch.UntypedStorage.resize_
    with memfit.track():
        with memfit.track():
            inside = torch.UntypedStorage.resize_
        assert torch.UntypedStorage.resize_ is inside
    assert torch.UntypedStorage.resize_ is before and inside is not before
