"""The optimizer implementation as a planner choice (issue 11 item 13).

On a CUDA target torch optimizers default to foreach, whose step holds parameter-sized
temporaries; a fused step does not. Where the budget lies between the two plain steps
(both traced here: the oracle), the planner takes the fused optimizer instead of moving the
optimizer state to the host; an optimizer instance keeps its own implementation unless
``optimizer_impl`` is set, and ``OptimizerRecipe`` rebuilds it with the planned one.
"""

import pytest
import torch

import memfit
from memfit.optimizers import OptimizerRecipe, impl_of
from tests.helpers import tiny

GPU = "gtx-1080-ti"


def _model():
    """bert-base's widths (one layer) on the meta device, one short sample: the weights
    dominate, so the step peaks in the optimizer, by more than the allocator's segments."""
    from memfit import zoo
    spec = zoo.get("bert-base")
    model = spec.build(device="meta", num_hidden_layers=1)
    return model, spec.make_batch(model, 1, seq_len=8)


def test_fused_is_planned_before_offloading_the_optimizer():
    model, batch = _model()
    foreach = memfit.estimate(model, batch, device=GPU)
    fused = memfit.estimate(model, batch, device=GPU, optimizer_impl="fused")
    assert "optimizer foreach" in foreach.notes[0] and "optimizer fused" in fused.notes[0]
    assert fused.device_bytes < foreach.device_bytes          # the premise, traced
    budget = (fused.device_bytes + foreach.device_bytes) // 2
    p = memfit.plan(model, batch, budget=budget, device=GPU)
    assert p.knobs.optimizer_impl == "fused" and p.knobs.offload_optimizer is False
    assert p.predicted_device_bytes <= budget
    assert any("optimizer fused (memfit's choice" in r for r in p.reasons)
    assert "fused optimizer" in p.explain()
    # an instance keeps its own implementation: the planner must find another way
    params = [q for q in model.parameters() if q.requires_grad]
    mine = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    q = memfit.plan(model, batch, budget=budget, device=GPU, optimizer=mine)
    assert q.knobs.optimizer_impl is None
    assert q.predicted_device_bytes <= budget


def test_recipe_rebuilds_with_the_implementation():
    model, _ = tiny("bert-base")
    params = [q for q in model.parameters() if q.requires_grad]
    mine = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)
    assert OptimizerRecipe(mine).build(params, params) is mine
    fused = OptimizerRecipe(mine, impl="fused").build(params, params)
    assert fused is not mine and impl_of(fused, cuda=True) == "fused"
    g = fused.param_groups[0]
    assert (g["lr"], g["weight_decay"]) == (3e-4, 0.1)
    loop = OptimizerRecipe("adamw", impl="for-loop").build(params, params)
    assert impl_of(loop, cuda=True) == "for-loop"


def test_bad_implementation_is_refused_before_tracing():
    model, batch = tiny("bert-base")
    with pytest.raises(ValueError, match="optimizer_impl='fast'"):
        memfit.Knobs(optimizer_impl="fast")
    with pytest.raises(ValueError, match="RMSprop has no fused"):
        memfit.estimate(model, batch, optimizer="rmsprop", optimizer_impl="fused")
