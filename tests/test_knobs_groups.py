"""``Knobs`` by concern (``memfit.knobs`` Note 1): the groups are views of the flat fields, every
field belongs to exactly one concern, a group is checked as the flat knobs are, and the Job
fronts take a group keyword as the flat knobs it holds (same estimate)."""

import dataclasses

import pytest

import memfit
from memfit.knobs import (GROUPS, Batching, BlockPolicy, Knobs, OptimizerSetup, ParallelLayout,
                          expand_groups)
from tests.helpers import tiny


def test_every_knob_belongs_to_exactly_one_concern():
    flat = [f.name for f in dataclasses.fields(Knobs)]
    grouped = [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]
    assert sorted(grouped + ["precision", "remat", "quantize_base"]) == sorted(flat)
    assert not set(GROUPS) & set(flat)


def test_the_views_hold_the_flat_fields_and_round_trip():
    k = Knobs(precision="bf16", micro_batch_size=2, max_grad_norm=1.0, chunked_loss=8,
              checkpoint="every:2",
              offload_params="all", offload_optimizer=True, optimizer_state="8bit", gpus=2,
              sharding="fsdp", fsdp_offload=False, remat=False, optimizer_in_backward=False,
              quantize_base="nf4")
    assert k.batching == Batching(micro_batch_size=2, max_grad_norm=1.0, chunked_loss=8)
    assert k.block_policy == BlockPolicy(checkpoint="every:2", offload_params="all")
    assert k.optimizer_setup == OptimizerSetup(offload_optimizer=True, optimizer_state="8bit",
                                               optimizer_in_backward=False)
    assert k.parallel == ParallelLayout(gpus=2, sharding="fsdp", fsdp_offload=False)
    assert list(k.groups()) == ["precision", "batching", "block_policy", "optimizer_setup",
                                "parallel", "remat", "quantize_base"]
    assert Knobs.from_groups(**k.groups()) == k
    assert Knobs.from_groups() == Knobs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.batching.micro_batch_size = 4


@pytest.mark.parametrize("make, says", [
    (lambda: Batching(micro_batch_size=0), "micro_batch_size must be a positive int"),
    (lambda: Batching(zero_grad="later"), "zero_grad='later' is not one of"),
    (lambda: Batching(chunked_loss=-1), "chunked_loss must be a number of pieces"),
    (lambda: BlockPolicy(checkpoint="most"), "checkpoint='most'"),
    (lambda: OptimizerSetup(optimizer_state="int8"), "optimizer_state='int8' is not one of"),
    (lambda: OptimizerSetup(optimizer_in_backward=1), "optimizer_in_backward must be True or"),
    (lambda: ParallelLayout(gpus=0), "gpus must be an int >= 1"),
])
def test_a_group_is_checked_as_the_flat_knobs_are(make, says):
    with pytest.raises(ValueError, match=says):
        make()


def test_expand_groups_refuses_a_knob_given_twice_and_a_wrong_group():
    assert expand_groups({"precision": "fp16", "batching": Batching(micro_batch_size=2)}) == \
        {"precision": "fp16", "micro_batch_size": 2}
    with pytest.raises(ValueError, match="micro_batch_size is given twice"):
        expand_groups({"micro_batch_size": 4, "batching": Batching(micro_batch_size=2)})
    with pytest.raises(TypeError, match="parallel must be a memfit.knobs.ParallelLayout"):
        expand_groups({"parallel": Batching()})
    with pytest.raises(TypeError, match="batching: a group of knobs, which Knobs.from_groups"):
        Knobs.from_kwargs(batching=Batching())


def test_the_job_fronts_take_a_group_as_its_flat_knobs():
    model, batch = tiny("gpt2", batch_size=4)
    job = memfit.Job(model, batch)
    grouped = memfit.estimate(job, "cpu", batching=Batching(micro_batch_size=2),
                              block_policy=BlockPolicy(checkpoint="all"))
    flat = memfit.estimate(job, "cpu", micro_batch_size=2, checkpoint="all")
    assert grouped.knobs == flat.knobs and grouped.knobs.micro_batch_size == 2
    assert grouped.peak_bytes == flat.peak_bytes and grouped.breakdown == flat.breakdown


def test_a_plans_json_knobs_go_back_in_as_lists():
    """``plan --json`` writes per-block policies as lists: Knobs takes them as the tuples they
    were (a new-user sweep fed them back and was refused)."""
    k = Knobs(checkpoint=["h.0", "h.1"], offload=["h.2"], offload_params=["h.3"])
    assert (k.checkpoint, k.offload, k.offload_params) == (("h.0", "h.1"), ("h.2",), ("h.3",))
    with pytest.raises(ValueError, match="a policy string or a tuple of block names"):
        Knobs(checkpoint=["h.0", 1])
