"""``Knobs``: every bad value is refused with a message naming the knob and the valid values, and
knobs this version cannot apply yet are refused by ``check_available`` unless they are off."""

import pytest

from memfit.knobs import NOT_YET, Knobs


@pytest.mark.parametrize("bad,says", [
    (dict(gpus=0), "gpus must be an int >= 1 or 'auto'"),
    (dict(gpus=True), "gpus must be"),
    (dict(gpus="two"), "gpus must be"),
    (dict(sharding="zero3"), "sharding='zero3' is not one of none, ddp, fsdp"),
    (dict(reshard_after_forward=1), "group size >= 2"),
    (dict(reshard_after_forward="yes"), "reshard_after_forward must be"),
    (dict(optimizer_state="int8"), "optimizer_state='int8' is not one of fp32, bf16, 8bit, 4bit"),
    (dict(fsdp_offload="yes"), "fsdp_offload must be True or False"),
    (dict(checkpoint="bogus"), r"checkpoint='bogus': use .*'every:K' \(K >= 1\), 'selective', or"),
    (dict(offload="bogus"), r"offload='bogus': use .*'every:K' \(K >= 1\), or a tuple"),
    (dict(offload_params="bogus"), r"offload_params='bogus': use .*\(K >= 1\), or a tuple"),
    (dict(offload="selective"), r"offload='selective': use .*a checkpoint policy"),
])
def test_bad_values_name_the_knob(bad, says):
    with pytest.raises(ValueError, match=says):
        Knobs(**bad)


def test_good_values_are_kept():
    k = Knobs(gpus="auto", sharding="fsdp", reshard_after_forward=4, fsdp_offload=True,
              optimizer_state="8bit")
    assert k.to_dict()["reshard_after_forward"] == 4 and k.gpus == "auto"


@pytest.mark.parametrize("name,on,off", [
    ("gpus", 2, 1), ("sharding", "fsdp", "none"),
    ("fsdp_offload", True, False), ("reshard_after_forward", True, None),
])
def test_the_sharding_knobs_are_available_on_and_off(name, on, off):
    assert name not in NOT_YET                         # the planner shards (planner.sharding)
    Knobs(**{name: on}).check_available()
    Knobs(**{name: off}).check_available()


def test_unknown_knob_lists_the_valid_ones():
    with pytest.raises(TypeError, match="valid knobs: .*gpus.*sharding"):
        Knobs.from_kwargs(shards=2)
