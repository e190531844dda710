"""The config levers (memfit.api.levers) against direct estimates and real runs.

Oracles: ``memfit.estimate`` at the answer and one past it (on a CPU target the estimate is
exact, so "fits" is decided by the same count ``track`` makes); budgets are chosen from a
measured estimate so the answer is interior; the progressive phases are run for real with
``memfit.fit`` under ``memfit.track(budget=...)``, which raises past the budget.
"""

import pytest
import torch

import memfit
from memfit import zoo
from memfit._cache import Cache
from memfit.api._trace_cache import using
from memfit.api.levers import Largest, _Prober, largest_fitting
from memfit.studies import progressive, what_if
from memfit.api.plan import plan
from memfit.studies.what_if import scaled_hidden
from memfit.optimizers import OptimizerRecipe
from memfit.report.levers import what_if_table

SPEC = zoo.get("bert-base")


def _model(**overrides):
    return SPEC.build(tiny=True, seed=0, **overrides)


def _device_bytes(model, b, L, **knobs):
    return memfit.estimate(model, SPEC.make_batch(model, b, seq_len=L), device="cpu",
                           **knobs).device_bytes


def _plans(model, b, L, budget, **knobs) -> bool:
    """The oracle of levers Note 1: whether ``memfit.plan`` finds a plan at ``b`` x ``L``."""
    try:
        plan(model, SPEC.make_batch(model, b, seq_len=L), budget=budget, device="cpu", **knobs)
        return True
    except memfit.BudgetTooSmall:
        return False


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_largest_seq_len_is_the_longest_plan_fits_and_plan_refuses_one_more():
    model = _model()
    least = {"checkpoint": "all", "micro_batch_size": 1, "offload_optimizer": True}
    budget = _device_bytes(model, 2, 80, **least) + 100        # interior: near 80 of 128
    r = largest_fitting(SPEC, model, "seq_len", batch_size=2, seq_len=None, budget=budget,
                        device="cpu")
    assert isinstance(r, Largest) and r.capped_by is None and r.limit_bytes == budget
    assert _plans(model, 2, r.value, budget) and not _plans(model, 2, r.value + 1, budget)
    assert r.device_bytes == r.planned.plan.predicted_device_bytes <= budget
    assert r.knobs == {n: v for n, v in r.planned.plan.knobs.to_dict().items() if v is not None}


def test_largest_seq_len_is_capped_by_positions(tmp_path):
    # for the default tier's time: the levers fixed off (the cap is the positions' whatever
    # the plan at each length weighs), and the model on the meta device so that the plan at
    # the answer reads the probes' traces back from a trace cache (exact:
    # tests/api/test_trace_cache.py)
    model = _model(device="meta")
    with using(Cache(tmp_path)):
        r = largest_fitting(SPEC, model, "seq_len", batch_size=1, seq_len=None, budget="1GiB",
                            device="cpu", precision="fp32", optimizer_in_backward=False,
                            offload_gradients=False)
    assert r.value == 128 and "position" in r.capped_by
    assert r.planned.plan.predicted_device_bytes == r.device_bytes


@pytest.mark.slow      # 13-23 s each: the CI time limit (a lighter sibling stays)
def test_largest_batch_size_in_one_micro_batch_with_fixed_knobs():
    model = _model()
    L = 32
    one = {"checkpoint": "none", "precision": "fp32", "offload_optimizer": True}
    budget = _device_bytes(model, 6, L, micro_batch_size=6, **one) + 100
    r = largest_fitting(SPEC, model, "batch_size", batch_size=2, seq_len=L, budget=budget,
                        device="cpu", checkpoint="none")                 # a fixed knob is kept
    assert r.knobs["checkpoint"] == "none" and r.knobs["micro_batch_size"] == r.value
    assert _plans(model, r.value, L, budget, checkpoint="none", micro_batch_size=r.value)
    assert not _plans(model, r.value + 1, L, budget, checkpoint="none",
                      micro_batch_size=r.value + 1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        largest_fitting(SPEC, model, "batch_size", batch_size=2, seq_len=L, device="cpu",
                        micro_batch_size=2)


@pytest.mark.slow
def test_budget_below_the_smallest_value_gives_plans_floor():
    model = _model()
    floor = plan(model, SPEC.make_batch(model, 2, seq_len=1), device="cpu",
                 floor=True).floor_bytes
    with pytest.raises(memfit.BudgetTooSmall) as info:
        largest_fitting(SPEC, model, "seq_len", batch_size=2, seq_len=None, budget=floor - 1,
                        device="cpu")
    assert info.value.floor_bytes == floor and "seq_len=1" in str(info.value)


@pytest.mark.slow
def test_accumulated_probe_extrapolates_to_the_byte():
    """Note 3 of levers: 2 and 3 micro-batches predict 8 exactly (the full trace is the oracle)."""
    model = _model()
    prober = _Prober(SPEC, model, "seq_len", 8, None, None, memfit.get_device("cpu"), 2 ** 40,
                     "adamw", {}, lambda s: None)
    prober.learn(24)
    knobs = prober.knobs(24)
    assert knobs["micro_batch_size"] <= 2        # the floor accumulates (Note 3 applies)
    count = prober.count
    assert prober.fast(24) == _device_bytes(model, 8, 24, **knobs)
    assert prober.count - count == 2


@pytest.mark.slow
def test_what_if_rows_are_monotone_and_the_plain_row_exact():
    heard = []
    rows = what_if(SPEC, batch_size=2, seq_len=32, device="cpu", tiny=True,
                   factors=(0.5, 1.0, 2.0), precision="fp32", on_progress=heard.append)
    assert [(m.number, m.expected) for m in heard] == [(i, 7) for i in range(1, 8)]  # traces
    assert [r.lever for r in rows] == ["seq_len"] * 3 + ["hidden_size"] * 3 + ["num_layers"] * 3
    for lever in ("seq_len", "hidden_size", "num_layers"):
        group = [r for r in rows if r.lever == lever]
        assert [r.factor for r in group] == [0.5, 1.0, 2.0]
        peaks = [r.peak_bytes for r in group]
        assert peaks == sorted(peaks) and peaks[0] < peaks[2], (lever, peaks)
    assert [r.value for r in rows] == [16, 32, 64, 32, 64, 128, 1, 2, 4]
    plain = _device_bytes(_model(), 2, 32, precision="fp32")
    assert {r.device_bytes for r in rows if r.factor == 1.0} == {plain}
    assert what_if_table(rows).row_count == 9


def test_hidden_rounding_keeps_heads_dividing_hidden():
    config = SPEC.config(hidden_size=768, num_attention_heads=12, intermediate_size=3072)
    for f in (0.1, 0.3, 0.5, 0.77, 1.5):
        over = scaled_hidden(config, f)
        assert over["hidden_size"] % (12 * 8) == 0 and over["hidden_size"] >= 96
        assert over["intermediate_size"] % 8 == 0
    assert scaled_hidden(config, 0.5) == {"hidden_size": 384, "intermediate_size": 1536}


def _adamw(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return OptimizerRecipe("adamw").build(params, params)


@pytest.mark.slow
def test_progressive_phases_fit_and_run_under_the_budget():
    model = _model(num_hidden_layers=3)
    batch = SPEC.make_batch(model, 8, seq_len=96)
    plain = _device_bytes(model, 8, 96)
    budget = int(plain * 0.5)
    s = progressive(model, batch, budget, short_seq_len=24, device="cpu")
    short, long = s.phases
    assert (short.fraction, short.seq_len, long.seq_len) == (0.9, 24, 96)
    assert long.fraction == pytest.approx(0.1)
    for phase in s.phases:
        assert phase.plan.predicted_peak_bytes <= budget
    m_short = short.plan.knobs.micro_batch_size or 8
    m_long = long.plan.knobs.micro_batch_size or 8
    assert m_short >= m_long
    assert long.plan.reasons != ("the plain step fits: nothing to change",)    # half the plain
    assert 0 < s.predicted_time_ratio < 1 and short.plain_flops < long.plain_flops
    assert s.phase_at(0, 100) is short and s.phase_at(89, 100) is short
    assert s.phase_at(90, 100) is long and s.phase_at(99, 100) is long
    assert "phase 2" in s.explain() and len(s.to_dict()["phases"]) == 2
    for phase in s.phases:                      # real runs: track raises past the budget
        m = _model(num_hidden_layers=3)
        b = {k: v[:, :phase.seq_len].clone() if v.dim() == 2 else v for k, v in batch.items()}
        knobs = {k: v for k, v in phase.plan.knobs.to_dict().items() if v is not None}
        runner = memfit.fit(m, _adamw(m), b, **knobs)
        runner.step(b)
        with memfit.track(runner.model, runner.optimizer, budget=budget) as t:
            loss = runner.step(b)
        assert t.peak_bytes <= budget and torch.isfinite(torch.tensor(loss))


def test_progressive_refuses_bad_fraction_and_length():
    model = _model()
    batch = SPEC.make_batch(model, 2, seq_len=32)
    for f in (0, 1, 1.5, -0.1):
        with pytest.raises(ValueError, match="short_fraction"):
            progressive(model, batch, "1GiB", short_seq_len=16, short_fraction=f, device="cpu")
    for L in (0, 32, 40):
        with pytest.raises(ValueError, match="short_seq_len"):
            progressive(model, batch, "1GiB", short_seq_len=L, device="cpu")


def test_progressive_names_the_phase_that_cannot_fit():
    model = _model()
    batch = SPEC.make_batch(model, 2, seq_len=32)
    with pytest.raises(memfit.BudgetTooSmall, match="short phase"):
        progressive(model, batch, 1000, short_seq_len=16, device="cpu")


def test_what_if_scales_a_per_layer_list_with_the_depth():
    """Qwen3's config holds one layer type per layer: a row at half the depth had 9 layers and
    18 types, which transformers refused (the CLI's --what-if failed on such a config)."""
    import transformers as T

    from memfit.studies.what_if import _scaled_layers

    config = T.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, layer_types=["sliding_attention", "full_attention"] * 3)
    half = _scaled_layers(config, 0.5)
    assert half == {"num_hidden_layers": 3,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    T.Qwen3Config(**{**config.to_dict(), **half})          # a valid config
