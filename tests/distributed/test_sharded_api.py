"""estimate_sharded's contract apart from the figures: the fake group and memfit's counting
patches leave nothing behind (also when the trace raises), a real group is refused with the
fix, bad settings name themselves, and the per-rank state is what FSDP2's sharding rule says."""

import math

import pytest
import torch
import torch.distributed as dist

from memfit.api._sharded import estimate_sharded
from memfit.measure import _ledger, _modules
from tests.helpers import tiny

STORAGES_OF = _ledger.storages_of


def left_behind() -> list[str]:
    out = []
    if dist.is_initialized():
        out.append("a default process group")
    if "resize_" in vars(torch.UntypedStorage):
        out.append("UntypedStorage.resize_ patched")
    if _ledger.storages_of is not STORAGES_OF or _modules.storages_of is not STORAGES_OF:
        out.append("storages_of patched")
    return out


def test_nothing_left_behind_and_params_are_fsdp2_padded_shards():
    """Per rank, FSDP2 keeps dim 0 chunked in ceil(n / world) rows, every shard padded to
    that size (``_fsdp_param`` padding): the sharded parameters' bytes follow from the shapes
    alone; DDP keeps the whole model."""
    model, batch = tiny("gpt2")
    for world in (2, 3):
        est = estimate_sharded(model, batch, "sgd", device="cpu", world_size=world)
        assert left_behind() == []
        padded = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size()
                     for p in model.parameters())
        assert est.breakdown["params"] == padded
    est = estimate_sharded(model, batch, "sgd", device="cpu", world_size=2, sharding="ddp")
    assert est.breakdown["params"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert left_behind() == []


def test_a_trace_that_raises_leaves_nothing_behind():
    model, batch = tiny("gpt2")

    def loss_fn(model, batch):
        raise RuntimeError("the user's loss failed")

    with pytest.raises(RuntimeError, match="the user's loss failed"):
        estimate_sharded(model, batch, device="cpu", loss_fn=loss_fn, world_size=2)
    assert left_behind() == []


def test_refused_inside_a_process_group_which_is_left_alone():
    model, batch = tiny("gpt2")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="before init_process_group"):
            estimate_sharded(model, batch, device="cpu", world_size=2)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
    assert left_behind() == []


@pytest.mark.parametrize("kwargs,match", [
    ({"sharding": "zero3"}, "sharding='zero3'"),
    ({"reshard_after_forward": 0}, "reshard_after_forward=0"),
    ({"mp_policy": "fp16"}, "mp_policy='fp16'"),
    ({"sharding": "ddp", "mp_policy": "bf16"}, "FSDP's"),
    ({"world_size": 0}, "world_size=0"),
    ({"precision": "fp16"}, "precision='fp16'"),
    ({"precision": "bf16", "mp_policy": "bf16"}, "pick one"),
    ({"offload_optimizer": True}, "offload_optimizer"),
])
def test_bad_settings_name_themselves(kwargs, match):
    model, batch = tiny("gpt2")
    kwargs = {"world_size": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate_sharded(model, batch, device="cpu", **kwargs)
    assert left_behind() == []


def test_a_meta_model_gives_the_same_figures():
    """The model may be built on ``meta`` (no memory): the trace needs only shapes."""
    from memfit import zoo
    model, batch = tiny("gpt2")
    meta = zoo.get("gpt2").build(tiny=True, device="meta")
    real = estimate_sharded(model, batch, "sgd", device="cpu", world_size=2)
    fake = estimate_sharded(meta, batch, "sgd", device="cpu", world_size=2)
    assert (fake.peak_bytes, fake.breakdown) == (real.peak_bytes, real.breakdown)
    assert left_behind() == []
