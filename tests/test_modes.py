"""``memfit.Mode``: the one encoding of a block's mode (issue 27 item 1). It is a str (the old
strings compare equal, JSON is unchanged), bad strings are refused by name, and every producer
(the policy resolution with its "name:selective" language, ``Choice.modes``, ``Plan.blocks``
and ``Plan.from_json``, ``Applied.blocks``) hands out Mode members."""

import json

import pytest

from memfit import Mode
from memfit.knobs import Knobs
from memfit.planner import Plan
from memfit.planner.choice import Choice
from memfit.runtime import Applied
from memfit.techniques._blocks import resolve_policy
from tests.helpers import tiny


def test_a_mode_is_its_string():
    assert Mode.KEEP == "keep" and Mode.RECOMPUTE_OFFLOAD == "recompute+offload"
    assert str(Mode.SELECTIVE) == "selective" and f"{Mode.OFFLOAD:<9}|" == "offload  |"
    assert json.dumps({"b": Mode.RECOMPUTE}) == '{"b": "recompute"}'
    assert {Mode.KEEP: 1}["keep"] == 1


def test_parse_reads_the_strings_and_refuses_others_by_name():
    assert [Mode.parse(m.value) for m in Mode] == list(Mode)
    assert Mode.parse(Mode.KEEP) is Mode.KEEP
    for bad in ("Keep", "checkpoint", 3, None):
        with pytest.raises(ValueError, match="block mode .* is not one of keep, recompute, "
                                             "selective, offload, recompute\\+offload"):
            Mode.parse(bad)


def test_with_offload_and_the_predicates():
    assert [m.with_offload() for m in (Mode.KEEP, Mode.RECOMPUTE, Mode.SELECTIVE, Mode.OFFLOAD)] \
        == [Mode.OFFLOAD, Mode.RECOMPUTE_OFFLOAD, Mode.SELECTIVE_OFFLOAD, Mode.OFFLOAD]
    assert [m for m in Mode if m.recomputes] == [Mode.RECOMPUTE, Mode.SELECTIVE,
                                                 Mode.RECOMPUTE_OFFLOAD, Mode.SELECTIVE_OFFLOAD]
    assert [m for m in Mode if m.offloads] == [Mode.OFFLOAD, Mode.RECOMPUTE_OFFLOAD,
                                               Mode.SELECTIVE_OFFLOAD]


def test_the_policy_language_resolves_to_modes():
    model, _ = tiny("gpt2")
    modes = resolve_policy(model, ("transformer.h.0:selective", "transformer.h.1"),
                           "recompute", "Checkpoint")
    assert modes == {"transformer.h.0": Mode.SELECTIVE, "transformer.h.1": Mode.RECOMPUTE}
    assert all(type(m) is Mode for m in modes.values())
    every = resolve_policy(model, "every:2", Mode.OFFLOAD, "Offload")
    assert list(every.values()) == [Mode.KEEP, Mode.OFFLOAD]
    with pytest.raises(ValueError, match="a offload entry is a module's qualified name"):
        resolve_policy(model, ("transformer.h.0:selective",), Mode.OFFLOAD, "Offload")


def test_choice_plan_and_applied_hold_modes_and_json_round_trips():
    c = Choice("fp32", 1, ("keep", "selective"), False, 1, 1, 0.1)
    assert c.modes == (Mode.KEEP, Mode.SELECTIVE) and all(type(m) is Mode for m in c.modes)
    plan = Plan(Knobs(), blocks={"a": "recompute+offload", "b": Mode.KEEP},
                block_costs=[{"name": "a", "mode": "recompute", "saved_bytes": 1, "time_s": 0.0}])
    assert all(type(m) is Mode for m in plan.blocks.values())
    assert type(plan.block_costs[0]["mode"]) is Mode
    text = plan.to_json()
    assert json.loads(text)["blocks"] == {"a": "recompute+offload", "b": "keep"}
    again = Plan.from_json(text)
    assert again == plan and all(type(m) is Mode for m in again.blocks.values())
    assert type(again.block_costs[0]["mode"]) is Mode
    assert type(Applied(blocks={"a": "offload"}).blocks["a"]) is Mode
    with pytest.raises(ValueError, match="block mode 'fast'"):
        Plan(Knobs(), blocks={"a": "fast"})


def test_the_plans_json_keeps_the_blocks_in_their_order():
    """h.10 came before h.2 (the keys were sorted as text)."""
    names = [f"h.{i}" for i in range(12)]
    plan = Plan(Knobs(), blocks={n: "keep" for n in names})
    assert list(json.loads(plan.to_json())["blocks"]) == names
    assert list(Plan.from_json(plan.to_json()).blocks) == names
