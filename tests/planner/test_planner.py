"""The planner on CPU, where its re-trace is exact: plans applied by ``fit`` never exceed their
budget under ``memfit.track``; a budget the plain step fits changes nothing; a lower budget is
never predicted faster; below the floor, ``BudgetTooSmall``.

Expected values come from measurement in the same test: the plain step's peak (``track``), and
the floor reported by the planner itself (re-traced, so a budget 10% above it must plan).
"""

import pytest
import torch

import memfit
from memfit.optimizers import OptimizerRecipe
from tests.helpers import tiny, track_real_step

ARCHS = {   # name -> (batch, sequence length, config overrides): activations worth planning
    "bert-base": (8, 64, {"num_hidden_layers": 4}),
    "gpt2": (8, 64, {"n_layer": 4}),
    "llama-1b": (8, 64, {"num_hidden_layers": 4}),
    "vit-base": (8, None, {"num_hidden_layers": 4}),
}


def _model(name):
    from memfit import zoo
    b, L, overrides = ARCHS[name]
    spec = zoo.get(name)
    model = spec.build(tiny=True, seed=0, **overrides)
    text = spec.family != "vision"
    batch = spec.make_batch(model, b, seq_len=L if text else None, seed=0)
    return model, batch


def _sgd(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return OptimizerRecipe("adamw").build(params, params)


def _plain_peak(name):
    """The plain step as a user runs it: ``runner.step(batch)`` (steady state), measured."""
    m, b = _model(name)
    runner = memfit.fit(m, _sgd(m), b)
    runner.step(b)
    with memfit.track(runner.model, runner.optimizer) as t:
        runner.step(b)
    return t.peak_bytes


def _run_under(model, batch, budget, runner):
    """One step untracked (steady state), then the next ``runner.step(batch)`` under
    track(budget): the caller's batch (its unused all-ones mask included) is counted too."""
    runner.step(batch)
    with memfit.track(runner.model, runner.optimizer, budget=budget) as t:
        runner.step(batch)
    return t


# gpt2 in the default tier; the other architectures (minutes each since every plan traces its
# floor, api._planner Note 4) with --runslow
@pytest.mark.slow
@pytest.mark.parametrize("name", [n if n == "gpt2" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in ARCHS])
def test_plans_fit_their_budgets(name):
    model, batch = _model(name)
    plain = _plain_peak(name)                                    # the plain step, measured
    try:
        memfit.plan(model, batch, budget=plain // 50, floor=True)    # traced, not the bound
    except memfit.BudgetTooSmall as e:
        floor = e.floor_bytes
    else:
        pytest.fail("a budget of 2% of the plain peak should be below any floor")
    budgets = [plain, int(plain * 0.75), int(plain * 0.5), int(plain * 0.3), int(floor * 1.1)]
    ratios = []
    for budget in sorted(budgets, reverse=True):
        if budget < floor:
            with pytest.raises(memfit.BudgetTooSmall) as info:
                memfit.plan(model, batch, budget=budget)
            e = info.value          # refused under the floor, or before tracing under its bound
            assert e.floor_bytes == floor or e.floor_is_bound and budget < e.floor_bytes <= floor
            continue
        m, b = _model(name)
        runner = memfit.fit(m, _sgd(m), b, budget=budget)
        p = runner.plan
        assert p.predicted_peak_bytes <= budget
        t = _run_under(m, b, budget, runner)                     # raises past the budget
        assert t.peak_bytes == p.predicted_peak_bytes            # CPU: the re-trace is exact
        ratios.append(p.predicted_step_time_ratio)
        if budget >= plain:
            assert p.knobs.micro_batch_size in (None, 8)
            assert (p.knobs.checkpoint, p.knobs.offload, p.knobs.offload_optimizer) == \
                ("none", "none", False)
            assert set(p.blocks.values()) <= {"keep"}
            assert p.predicted_step_time_ratio == pytest.approx(1.0)
    assert ratios == sorted(ratios), f"a lower budget was predicted faster: {ratios}"


@pytest.mark.slow
def test_fixed_knobs_are_kept():
    model, batch = _model("gpt2")
    plain = track_real_step(*_model("gpt2")).peak_bytes
    p = memfit.plan(model, batch, budget=int(plain * 0.6), micro_batch_size=4,
                    offload_optimizer=False)
    assert p.knobs.micro_batch_size == 4 and p.knobs.offload_optimizer is False
    assert p.predicted_peak_bytes <= int(plain * 0.6)
    p = memfit.plan(model, batch, budget=int(plain * 0.9), checkpoint="all")
    assert p.knobs.checkpoint == "all"
    assert set(p.blocks.values()) == {"recompute"}


def test_plan_round_trips_and_explains():
    model, batch = _model("bert-base")
    plain = track_real_step(*_model("bert-base")).peak_bytes
    p = memfit.plan(model, batch, budget=int(plain * 0.5))
    q = memfit.Plan.from_json(p.to_json())
    assert q == p
    text = p.explain()
    assert "predicted: peak" in text and "bert.encoder.layer.0" in text and "why:" in text
    assert len(p.block_costs) == 4


def test_mixed_selective_tuple_is_bitwise_plain():
    """A planner's mixed recompute tuple ("name:selective") changes where bytes live only."""
    from tests.helpers import equal_params, train_seeded
    from memfit.techniques.checkpoint import Checkpoint
    plain = train_seeded(*tiny("bert-base", batch_size=2, seq_len=8))
    model, batch = tiny("bert-base", batch_size=2, seq_len=8)
    handle = Checkpoint(Checkpoint.Config(("bert.encoder.layer.0:selective",
                                           "bert.encoder.layer.1"))).apply(model)
    assert handle.modes == {"bert.encoder.layer.0": "selective", "bert.encoder.layer.1": "recompute"}
    train_seeded(model, batch)
    assert equal_params(plain, model)
    with pytest.raises(ValueError, match="qualified name"):
        memfit.estimate(*tiny("bert-base"), offload=("bert.encoder.layer.0:selective",))


def test_bad_budget_is_refused_before_tracing():
    model, batch = _model("gpt2")
    with pytest.raises(ValueError):
        memfit.plan(model, batch, budget="eleven gigs")
    with pytest.raises(TypeError, match="valid knobs"):
        memfit.plan(model, batch, budget="1GiB", precission="fp16")
    with pytest.raises(ValueError, match="remat=True with micro_batch_size fixed"):
        memfit.plan(model, batch, budget="1GiB", remat=True, micro_batch_size=2)
    # the warning comes before tracing: a batch the model cannot take then stops the plan
    with pytest.warns(UserWarning, match="usable"), pytest.raises(ValueError, match="loss"):
        memfit.plan(model, {"input_ids": batch["input_ids"]}, budget="40GiB",
                    device="gtx-1080-ti")
    assert torch.is_tensor(batch["input_ids"])


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_one_micro_batch_can_need_less_than_micro_batch_one():
    """Accumulating keeps every gradient alive through the later micro-batches, so the whole
    batch at once may be the least-memory choice: the planner must find it (search Note 2)."""
    model, batch = tiny("bert-base", batch_size=2, seq_len=8)
    whole = memfit.estimate(model, batch, micro_batch_size=2, offload_optimizer=True)
    ones = [memfit.estimate(model, batch, micro_batch_size=1, offload_optimizer=True,
                            checkpoint=c).peak_bytes for c in ("none", "all", "selective")]
    assert whole.peak_bytes < min(ones)           # the premise, measured
    budget = whole.peak_bytes + 4096              # + the unused all-ones mask runner.step holds
    p = memfit.plan(model, batch, budget=budget, floor=True)
    assert p.predicted_peak_bytes <= budget and p.knobs.micro_batch_size == 2
    assert p.floor_bytes <= budget


@pytest.mark.slow      # 13-23 s each: the CI time limit (a lighter sibling stays)
def test_fixed_checkpoint_and_offload_are_kept_verbatim():
    model, batch = _model("gpt2")
    plain = _plain_peak("gpt2")
    p = memfit.plan(model, batch, budget=int(plain * 0.95), checkpoint=("transformer.h.0.mlp",))
    assert p.knobs.checkpoint == ("transformer.h.0.mlp",) and p.knobs.offload == "none"
    p = memfit.plan(model, batch, budget=int(plain * 0.9), checkpoint="all", offload="all")
    assert (p.knobs.checkpoint, p.knobs.offload) == ("all", "all")
    m, b = _model("gpt2")
    runner = memfit.fit(m, _sgd(m), b, budget=int(plain * 0.9), checkpoint="all", offload="all")
    assert set(runner.applied.blocks.values()) == {"recompute+offload"}
