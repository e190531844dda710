"""Low-bit optimizer states as a planner lever (issue 15 item 1).

Oracles: ``memfit.track`` on CPU (the planner's models and its re-trace must equal what a real
run measures, to the byte), and fp32 AdamW itself for the numerics. The 8-bit tolerance is
torchao's own: the one comparison of a low-bit state with fp32 AdamW in torchao's test suite
(``test_optim_bf16_stochastic_round_correctness``) holds the losses of the two runs to
``torch.testing.assert_close``'s bf16 defaults (rtol 1.6e-2, atol 1e-5); it is applied here to
20 steps of an MLP whose weights torchao quantizes (>= 4096 values each).
"""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import memfit
from memfit.planner.memory_model import MODES, MemoryModel
from memfit.planner.choice import Constraints, variant_key
from memfit.planner.search import search
from memfit.planner.time_model import TimeModel
from tests.helpers import tiny, track_runner_step

pytest.importorskip("torchao.optim")

BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5       # torch.testing.assert_close's bf16 defaults


def _gpt2(b=1):
    model, batch = tiny("gpt2", batch_size=b, seq_len=16)
    del batch["attention_mask"]           # all ones: the plan would count it held
    return model, batch


def _keep_all(memory: MemoryModel) -> np.ndarray:
    x = np.zeros(len(memory.blocks) * len(MODES))
    x[[i * len(MODES) for i in range(len(memory.blocks))]] = 1.0
    return x


@pytest.mark.parametrize("state", [
    "8bit", pytest.param("bf16", marks=pytest.mark.slow), pytest.param("4bit", marks=pytest.mark.slow)])
def test_the_state_model_predicts_what_track_measures(state):
    """memory_model Note 9: the fp32-state model shifted by one trace with the state predicts
    that step's peak to the byte, and a real run of it measures the same."""
    model, batch = _gpt2()
    plain = memfit.estimate(model, batch)
    variant = MemoryModel(plain, 1).with_optimizer_state(
        memfit.estimate(model, batch, optimizer_state=state))
    predicted = variant.rows(1, 1, accumulate=False, offload_optimizer=False).peak(
        _keep_all(variant))
    measured = track_runner_step(model, batch, "adamw", optimizer_state=state)
    assert predicted == measured.peak_bytes
    assert variant.optimizer_state_bytes == measured.breakdown["optimizer"]


def test_search_takes_the_low_bit_model_only_where_nothing_else_fits():
    """Between the two peaks (every block kept, one micro-batch, state on the device) the
    search's only answer is the low-bit model's; without that model there is none."""
    model, batch = _gpt2()
    plain = memfit.estimate(model, batch)
    est = memfit.estimate(model, batch, optimizer_state="bf16")
    spec = plain.device
    memory = MemoryModel(plain, 1)
    base = (memory, TimeModel(plain, spec, "fp32", 1, memory))
    low = (memory.with_optimizer_state(est), base[1].with_optimizer_step(est))
    models = {("fp32", None): base, variant_key("fp32", None, "bf16"): low}
    assert est.peak_bytes < plain.peak_bytes          # the premise, traced
    between = (est.peak_bytes + plain.peak_bytes) // 2
    fixed = Constraints(micro_batch_size=1, modes={n: ("keep",) for n in memory.blocks},
                        offload_optimizer=False)
    assert search({("fp32", None): base}, 1, between, fixed) is None
    chosen = search(models, 1, between, fixed)
    assert chosen.optimizer_state == "bf16" and chosen.device_bytes <= between
    assert chosen.key == variant_key("fp32", None, "bf16")


def test_8bit_state_follows_fp32_adamw_within_torchaos_tolerance():
    torch.manual_seed(2024)
    fp32 = nn.Sequential(nn.Linear(32, 1024), nn.ReLU(), nn.Linear(1024, 128))
    low = copy.deepcopy(fp32)
    batch = (torch.randn(4, 32), torch.randn(4, 128))

    def loss_fn(model, b):
        return nn.functional.mse_loss(model(b[0]), b[1])

    runs = [memfit.fit(m, torch.optim.AdamW(m.parameters(), lr=1e-3), batch, loss_fn=loss_fn,
                       **extra) for m, extra in ((fp32, {}), (low, {"optimizer_state": "8bit"}))]
    losses = [[r.step(batch) for _ in range(20)] for r in runs]
    assert runs[1].optimizer.state[low[0].weight]["state1"].dtype == torch.uint8   # bitsandbytes
    assert losses[0] != losses[1]                     # the state really is 8-bit
    assert losses[1][-1] < 0.1 * losses[1][0]         # and it trains
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]),
                               rtol=BF16_RTOL, atol=BF16_ATOL)


@pytest.mark.slow      # three plans with floors (~1-2 min on 2 cores); light siblings above
def test_plan_weighs_low_bit_states_only_when_numerics_may_change():
    """With the optimizer state kept on the device, a budget below the fp32-state floor
    raises unless numerics may change; then the plan holds a low-bit state, says so, and a
    real run of it stays under the budget, measured at the predicted peak."""
    model, batch = _gpt2(2)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=1, offload_optimizer=False, floor=True)
    fp32_floor = info.value.floor_bytes
    with pytest.raises(memfit.BudgetTooSmall):
        memfit.plan(model, batch, budget=fp32_floor - 1, offload_optimizer=False)
    p = memfit.plan(model, batch, budget=fp32_floor - 1, offload_optimizer=False,
                    allow_numerics_change=True, floor=True)
    assert p.knobs.optimizer_state in ("bf16", "8bit", "4bit")
    assert any("changes the numerics" in r for r in p.reasons)
    assert "changes the numerics" in p.explain()
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    measured = track_runner_step(*_gpt2(2), "adamw", **knobs)
    assert measured.peak_bytes == p.predicted_peak_bytes <= fp32_floor - 1
    # the floor fell by what the two least configurations measure
    assert p.floor_bytes <= measured.peak_bytes < fp32_floor


@pytest.mark.slow      # a floor and two plans (~1-2 min on 2 cores)
def test_fit_passes_allow_numerics_change_to_its_plan():
    """memfit.fit(..., allow_numerics_change=True) plans what memfit.plan plans with it: below
    the fp32-state floor a low-bit state, and without it BudgetTooSmall."""
    model, batch = _gpt2(2)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=1, offload_optimizer=False, floor=True)
    budget = info.value.floor_bytes - 1
    expected = memfit.plan(model, batch, budget=budget, offload_optimizer=False,
                           allow_numerics_change=True)
    factory = lambda params: torch.optim.AdamW(params, lr=1e-3)      # noqa: E731
    with pytest.raises(memfit.BudgetTooSmall):
        memfit.fit(*_gpt2_pair(factory), budget=budget, offload_optimizer=False)
    runner = memfit.fit(*_gpt2_pair(factory), budget=budget, offload_optimizer=False,
                        allow_numerics_change=True)
    try:
        assert runner.plan.knobs == expected.knobs
        assert runner.plan.knobs.optimizer_state in ("bf16", "8bit", "4bit")
    finally:
        runner.close()


def _gpt2_pair(optimizer):
    model, batch = _gpt2(2)
    return model, optimizer, batch


@pytest.mark.slow      # two floors of a 2.6 MB GPT-2 (~2-4 min on 2 cores)
def test_8bit_state_lowers_the_floor_of_an_embedding_heavy_model():
    """Issue 26 item 13: with the state on the device, the least any plan needs with 8-bit
    state (bitsandbytes) is below the least with fp32 state, and a real run of the 8-bit
    floor's configuration measures what the floor says (track; the step's kernel temporaries
    are held to the CPU allocator's events in tests/techniques/test_low_bit_optimizer.py).
    Before, torchao's eager step made the 8-bit floor the higher one."""
    from tests.techniques.test_low_bit_optimizer import _embedding_heavy

    floors = {}
    for state in (None, "8bit"):
        with pytest.raises(memfit.BudgetTooSmall) as info:
            memfit.plan(*_embedding_heavy(), budget=1, offload_optimizer=False,
                        optimizer_state=state, floor=True)
        floors[state] = info.value
    assert floors["8bit"].floor_bytes < floors[None].floor_bytes
    p = memfit.plan(*_embedding_heavy(), budget=floors["8bit"].floor_bytes,
                    offload_optimizer=False, optimizer_state="8bit")
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    measured = track_runner_step(*_embedding_heavy(), "adamw", **knobs)
    assert measured.peak_bytes == p.predicted_peak_bytes <= floors["8bit"].floor_bytes
