"""A Plan is immutable (plan Note 1); what building a Runner did is ``runner.applied``."""

import dataclasses

import pytest
import torch

import memfit
from memfit.api._setup import build_runner
from memfit.knobs import Knobs
from memfit.measure import find_blocks
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.runtime import Applied
from tests.helpers import tiny


def test_a_plan_cannot_be_changed():
    p = Plan(Knobs(checkpoint="all"), blocks={"a": "recompute"}, reasons=["why"],
             block_costs=[{"name": "a", "mode": "recompute"}])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget_bytes = 1
    with pytest.raises(TypeError):
        p.blocks["a"] = "keep"
    with pytest.raises(TypeError):
        p.block_costs[0]["mode"] = "keep"
    with pytest.raises(AttributeError):
        p.reasons.append("more")
    assert p.reasons == ("why",) and p.blocks == {"a": "recompute"}
    with pytest.raises(ValueError, match="sequence of str"):
        Plan(Knobs(), reasons="one string")


def test_json_round_trip_and_copies():
    p = Plan(Knobs(checkpoint=("h.0", "h.1"), micro_batch_size=2), blocks={"h.0": "recompute"},
             reasons=["a", "b"], block_costs=[{"name": "h.0", "mode": "recompute",
                                                "saved_bytes": 10, "time_s": 0.5}],
             predicted_peak_bytes=123, budget_bytes=456)
    text = p.to_json()
    assert Plan.from_json(text) == p and Plan.from_json(text).to_json() == text
    import copy
    import pickle
    assert copy.deepcopy(p) == p == pickle.loads(pickle.dumps(p))
    assert dataclasses.replace(p, budget_bytes=1).budget_bytes == 1 and p.budget_bytes == 456


def test_building_a_runner_leaves_the_plan_as_it_was():
    # Before: build_runner wrote the modes of every block, "optimizer_rebuilt" and its notes
    # into the plan it was given.
    model, batch = tiny("gpt2")
    opt = torch.optim.AdamW(model.parameters())
    k = Knobs(precision="fp32", checkpoint="every:2", offload="all", offload_optimizer=True,
              remat=True)
    plan = Plan(k, reasons=["searched"])
    before = plan.to_json()
    runner = build_runner(model, OptimizerRecipe(opt), k, plan=plan)
    assert runner.plan is plan and plan.to_json() == before
    blocks = find_blocks(model)
    assert isinstance(runner.applied, Applied)
    assert dict(runner.applied.blocks) == {b: "recompute+offload" if i % 2 else "offload"
                                           for i, b in enumerate(blocks)}
    assert runner.applied.optimizer_rebuilt and runner.optimizer is not opt
    assert any("offload_optimizer" in n for n in runner.applied.notes)
    assert any("remat" in n for n in runner.applied.notes)
    runner.close()


def test_fit_records_what_it_did_in_applied():
    model, batch = tiny("gpt2")
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                        precision="bf16-pure", checkpoint="all")
    assert runner.plan.blocks == {} and runner.plan.reasons == ()
    assert set(runner.applied.blocks.values()) == {"recompute"}
    assert runner.applied.optimizer_rebuilt and runner.plan.optimizer_rebuilt
    assert any(n.startswith("bf16-pure") for n in runner.applied.notes)
    runner.step(batch)
    runner.close()
