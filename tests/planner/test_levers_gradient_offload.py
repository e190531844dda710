"""The gradients moved to the host in backward as a planner lever (``offload_gradients``, issue
28 items 3 and 6): weighed when nothing else fits, before the block weights on the host, by its
traced memory and its modelled cost (every gradient over the host link per micro-batch).

The job: two 256 x 256 linear layers at batch 2, AdamW (``foreach=False``), fp32 on the CPU:
the weights and gradients dominate, no block to recompute. With the optimizer state on the host
its step still peaks with every gradient on the device (1,060,868 B); moving each gradient to
the host as backward makes it leaves one layer's (801,796 B). A budget halfway between is
under everything else the planner has (micro-batches keep every gradient too, the optimizer in
backward keeps the state on the device, and fp32 allows no low-bit state).

Oracles that are not the planner: ``LiveBytes`` over a real ``Runner`` step
(``tests/live_bytes.py``), and the same model trained by hand with AdamW (bitwise: the update
is the same, on the host).
"""


import pytest
import torch
from torch import nn

import memfit
from tests.live_bytes import LiveBytes, alive_storages, job_tensors
# the optimizer, and the autouse fixture that quiets optimizer offload's CPU warning
from tests.techniques.test_gradient_offload import ADAMW, _quiet  # noqa: F401

LOSS = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])      # noqa: E731


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)), \
        (torch.randn(2, 256), torch.randn(2, 256))


def _job(model, batch):
    return memfit.Job(model, batch, optimizer=ADAMW, loss_fn=LOSS)


def _budget() -> int:
    model, batch = _mlp()
    peaks = [memfit.estimate(_job(model, batch), offload_optimizer=True, **knobs).peak_bytes
             for knobs in ({}, {"offload_gradients": True})]
    assert peaks[1] < peaks[0]
    return sum(peaks) // 2


def test_plan_takes_the_gradients_to_the_host_where_only_they_fit_and_the_run_stays_under():
    budget = _budget()
    model, batch = _mlp()
    p = memfit.plan(_job(model, batch), budget=budget, device="cpu")
    assert p.knobs.offload_gradients and p.knobs.offload_optimizer
    assert p.predicted_peak_bytes <= budget
    assert any(r.startswith("gradients on the host (offload_gradients=True)") for r in p.reasons)
    assert "gradients to the host" in p.explain()

    reference, _ = _mlp()                 # trained by hand: the same AdamW on the device
    before = alive_storages()
    model, batch = _mlp()
    runner = memfit.fit(_job(model, batch), budget=budget, device="cpu")
    assert runner.plan.knobs.offload_gradients
    runner.step(batch)
    with LiveBytes(host_tensors=runner.optimizer.host_tensors(),
                   device_tensors=job_tensors(before)) as live:
        runner.step(batch)
    runner.close()
    assert live.peak_bytes == runner.plan.predicted_peak_bytes <= budget
    opt = ADAMW(reference.parameters())
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        LOSS(reference, batch).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_a_fixed_choice_is_kept():
    """``offload_gradients=True`` is in every trace (the optimizer state on the host with it);
    ``False`` keeps it out, and then nothing fits this budget."""
    budget = _budget()
    model, batch = _mlp()
    p = memfit.plan(_job(model, batch), budget=4 * budget, device="cpu", offload_gradients=True)
    assert p.knobs.offload_gradients and p.knobs.offload_optimizer
    with pytest.raises(memfit.BudgetTooSmall, match="offload_gradients"):
        memfit.plan(_job(model, batch), budget=budget, device="cpu", offload_gradients=False)


@pytest.mark.slow
def test_the_last_resorts_are_weighed_when_every_pick_misses_its_trace():
    """llama-1b, 8 x 2 tokens, on a GTX 1080 Ti (found by a new-user sweep): the models put
    five fp16 picks at 10.82 GiB, each re-traced over the 10.92 GiB budget; the verify loop's
    attempts were spent, the gradients on the host were never weighed, and plan refused at
    the floor's 11.11 GiB, while ``floor=True`` (which weighs every lever first) planned 8.26
    GiB. Now every pick missing is "nothing fits" for the last resorts too, and both agree."""
    from memfit import zoo

    spec = zoo.get("llama-1b")
    model = spec.build(device="meta")
    batch = spec.make_batch(model, 8, seq_len=2)
    plan = memfit.plan(memfit.Job(model, batch), device="gtx-1080-ti", precision="auto")
    floor = memfit.plan(memfit.Job(model, batch), device="gtx-1080-ti", precision="auto",
                        floor=True)
    assert plan.knobs.offload_gradients and plan.knobs == floor.knobs
    assert plan.predicted_device_bytes == floor.predicted_device_bytes <= plan.budget_bytes
    # below it, the refusal's floor is no higher than that plan: the least of each way the
    # state is placed is a floor candidate (planner.search Note 5); the parameter-offload
    # model's optimistic least alone made it 11.11 GiB
    below = plan.predicted_device_bytes - 2 ** 28
    with pytest.raises(memfit.BudgetTooSmall) as refused:
        memfit.plan(memfit.Job(model, batch), budget=below, device="gtx-1080-ti",
                    precision="auto")
    assert below < refused.value.floor_bytes <= plan.predicted_device_bytes
