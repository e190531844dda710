"""``memfit.plan(gpus="auto" | N, sharding=...)``: the layout and per-rank plan, verified.

Oracles: ``memfit.estimate(gpus=N, sharding=...)`` of the plan's own knobs on one rank's batch
(estimate_sharded, itself equal to real gloo ranks to the byte: tests/distributed) must give
the plan's predicted bytes, under the budget; the budget is set below what one device's state
alone needs (parameters + gradients + AdamW state, counted by hand from the parameter count),
so one GPU cannot be the answer.
"""

import dataclasses

import pytest

import memfit
from memfit.api._plan_sharded import compare_gpus, plan_sharded_traced
from memfit.api.plan import plan_traced
from memfit.devices import get_device
from tests.helpers import tiny


@pytest.fixture(scope="module")
def gpt2():
    model, batch = tiny("gpt2", batch_size=4, seq_len=16)
    state = sum(p.numel() for p in model.parameters()) * 4 * 4   # fp32 param, grad, 2 moments
    return model, batch, state


@pytest.fixture(scope="module")
def auto(gpt2):
    model, batch, state = gpt2
    budget = int(state * 0.9)
    return plan_sharded_traced(model, batch, budget, "adamw", "cpu", gpus="auto",
                               offload_optimizer=False), budget


@pytest.mark.slow          # 2 traces + 1-3 sharded re-traces; light siblings: test_refusals,
def test_auto_shards_and_the_retrace_is_the_answer(gpt2, auto):
    model, batch, _ = gpt2
    planned, budget = auto
    p = planned.plan
    assert p.knobs.gpus >= 2 and p.knobs.sharding == "fsdp"     # DDP holds the whole state
    assert p.predicted_device_bytes <= budget
    n = p.batch_size
    assert n == -(-4 // p.knobs.gpus)
    rank = {k: v[:n] for k, v in batch.items()}
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    knobs.pop("offload_optimizer", None)
    again = memfit.estimate(model, rank, "adamw", device="cpu", **knobs)
    assert again.peak_bytes == p.predicted_peak_bytes


@pytest.mark.slow          # test_sharding_export.py, tests/cli/test_plan_sharding.py
def test_the_plan_says_why(auto):
    planned, _ = auto
    text = " ".join(planned.plan.reasons)
    assert "each rank runs" in text and "collectives over" in text
    assert planned.step_s > 0


@pytest.mark.slow
def test_fixed_ddp_is_kept(gpt2):
    model, batch, state = gpt2
    p = memfit.plan(model, batch, state * 4, "adamw", "cpu", gpus=2, sharding="ddp")
    assert (p.knobs.gpus, p.knobs.sharding) == (2, "ddp")
    rank = {k: v[:2] for k, v in batch.items()}
    est = memfit.estimate(model, rank, "adamw", device="cpu", gpus=2, sharding="ddp")
    assert p.predicted_peak_bytes == est.peak_bytes


def test_refusals(gpt2):
    model, batch, state = gpt2
    with pytest.raises(ValueError, match="gpus <= 4"):
        memfit.plan(model, batch, state, "adamw", "cpu", gpus=8)
    with pytest.raises(ValueError, match="not weighed with sharding"):
        memfit.plan(model, batch, state, "adamw", "cpu", gpus=2, offload_optimizer=True)
    with pytest.raises(ValueError, match="use memfit.plan"):
        plan_traced(model, batch, state, "adamw", "cpu", gpus=2)


@pytest.mark.slow
def test_compare_gpus_orders_by_gpu_seconds(gpt2):
    model, batch, state = gpt2
    big = get_device("a100-40gb")
    small = dataclasses.replace(big, name="a100-small", usable_bytes=big.cuda_context_bytes +
                                big.cublas_workspace_bytes * 2 + int(state * 0.9))
    rows = compare_gpus(model, batch, "adamw", specs=[small, big], offload_optimizer=False)
    by = {r.gpu: r for r in rows}
    assert by["a100-40gb"].gpus == 1 and by["a100-small"].gpus >= 2
    seconds = [r.gpu_seconds for r in rows if r.gpu_seconds is not None]
    assert seconds == sorted(seconds)
    for r in rows:
        assert r.rank_bytes <= (small if r.gpu == "a100-small" else big).usable_bytes
