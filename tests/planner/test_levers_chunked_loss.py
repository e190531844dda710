"""The chunked loss as a planner lever (issue 28 items 4 and 6): weighed once the plain step
does not fit, by its traced memory and its modelled cost (the head's second forward).

The job: a Llama with a 32000-token vocabulary, hidden 64, 2 x 256 tokens, plain SGD, the
optimizer state kept on the device. Its plain step peaks at the logits; a budget of 100 MB is
under every configuration with the model's own loss (the planner's floor without the lever,
traced: 131,931,740 B, slow tier) and over the step with the loss in 8 pieces (54,775,112 B).

Oracles that are not the planner: ``LiveBytes`` over a real ``Runner`` step
(``tests/live_bytes.py``), and the same model trained with its own loss by hand (the
parameters after two SGD steps within 1e-6 of each tensor's largest: the chunked gradients
add the same terms in another order, ``tests/techniques/test_chunked_loss.py``).
"""

import pytest
import torch

import memfit
from tests.live_bytes import LiveBytes, alive_storages, job_tensors
from tests.techniques.test_chunked_loss import _big

BUDGET = 100_000_000


def _job(model, batch):
    return memfit.Job(model, batch, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


@pytest.mark.slow      # 15 s: a plan and a real run (the fixed-knob test stays in the default)
def test_plan_takes_the_chunked_loss_where_only_it_fits_and_the_run_stays_under():
    model, batch = _big()
    # the levers without it do not fit: the plain step, and micro-batch 1 with every block
    # recomputed (what the floor without the lever takes; traced in the slow test below)
    for knobs in ({}, dict(micro_batch_size=1, checkpoint="all")):
        assert memfit.estimate(_job(model, batch), device="cpu", **knobs).peak_bytes > BUDGET
    p = memfit.plan(_job(model, batch), budget=BUDGET, device="cpu", offload_optimizer=False)
    assert p.knobs.chunked_loss == 8
    assert p.predicted_peak_bytes <= BUDGET
    assert any(r.startswith("loss in 8 pieces (chunked_loss=8)") for r in p.reasons)
    assert "loss in 8 pieces" in p.explain()

    reference, _ = _big()                 # trained by hand, with the model's own loss
    before = alive_storages()
    model, batch = _big()
    runner = memfit.fit(_job(model, batch), budget=BUDGET, device="cpu", offload_optimizer=False)
    assert runner.plan.knobs.chunked_loss == 8
    runner.step(batch)
    with LiveBytes(device_tensors=job_tensors(before)) as live:
        runner.step(batch)
    runner.close()
    assert live.peak_bytes == runner.plan.predicted_peak_bytes <= BUDGET
    sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        sgd.zero_grad(set_to_none=True)
        reference(**batch).loss.backward()
        sgd.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


def test_a_fixed_chunked_loss_is_in_every_trace():
    model, batch = _big()
    p = memfit.plan(_job(model, batch), budget="1GiB", device="cpu", chunked_loss=4)
    est = memfit.estimate(_job(model, batch), device="cpu", chunked_loss=4)
    assert p.knobs.chunked_loss == 4 and p.predicted_peak_bytes == est.peak_bytes
    off = memfit.plan(_job(model, batch), budget="1GiB", device="cpu", chunked_loss=0)
    assert off.knobs.chunked_loss == 0 and off.predicted_peak_bytes > est.peak_bytes


@pytest.mark.slow      # a plan over every lever and three steps of 8-bit AdamW (~40 s)
@pytest.mark.filterwarnings("ignore::UserWarning")    # bitsandbytes on a CPU
def test_with_a_low_bit_state_beside_it():
    """The loss in pieces with 8-bit AdamW state (bitsandbytes), a model built from the two
    (planner.variants): at 83 MB only the pair fits (the loss in pieces alone with every
    block's activations offloaded needs 83,425,180 B, 8-bit state alone far more), and the
    run is what the plan predicts, to the byte."""
    before = alive_storages()
    model, batch = _big()
    runner = memfit.fit(memfit.Job(model, batch, optimizer=torch.optim.AdamW(model.parameters())),
                        budget=83_000_000, device="cpu", offload_optimizer=False,
                        allow_numerics_change=True)
    k = runner.plan.knobs
    assert (k.chunked_loss, k.optimizer_state) == (8, "8bit")
    for _ in range(2):
        runner.step(batch)
    with LiveBytes(device_tensors=job_tensors(before)) as live:
        runner.step(batch)
    runner.close()
    assert live.peak_bytes == runner.plan.predicted_peak_bytes == 82_881_092


@pytest.mark.slow      # the floor without the lever, traced (~20 s on 2 cores)
def test_nothing_with_the_models_own_loss_fits():
    model, batch = _big()
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(_job(model, batch), budget=BUDGET, device="cpu", offload_optimizer=False,
                    chunked_loss=0)
    assert info.value.floor_bytes == 131_931_740
    assert "the loss in pieces (chunked_loss=0)" in str(info.value)
