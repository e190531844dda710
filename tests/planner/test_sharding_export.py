"""The DeepSpeed export of a sharded plan: FSDP2 maps to ZeRO-3 and DDP to stage 0, each carrying
the plan's per-rank bytes (planner._export_deepspeed Note 3); a one-device plan stays as it was.
The expected bytes are the plan's own field (the plan's re-trace), nothing recomputed here."""

import pytest

from memfit.knobs import Knobs
from memfit.planner import Plan


@pytest.mark.parametrize("sharding,stage", [("fsdp", 3), ("ddp", 0)])
def test_sharded_plan_maps_to_its_zero_stage(sharding, stage):
    plan = Plan(Knobs(precision="fp32", micro_batch_size=2, gpus=2, sharding=sharding,
                      checkpoint="none", offload="none"),
                predicted_device_bytes=123_456, batch_size=2)
    out = plan.export("deepspeed", 2, world_size=2)
    assert out.config["zero_optimization"]["stage"] == stage
    assert out.per_rank_bytes == {stage: 123_456}
    assert out.config["train_batch_size"] == 4


def test_one_device_plan_has_no_per_rank_bytes():
    plan = Plan(Knobs(precision="fp32", micro_batch_size=2), batch_size=2)
    out = plan.export("deepspeed", 2)
    assert out.per_rank_bytes is None and out.config["zero_optimization"]["stage"] == 0
