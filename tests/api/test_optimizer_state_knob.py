"""optimizer_state through estimate and fit: bitsandbytes' and torchao's low-bit Adam, exact
against track, the
user's hyper-parameters and groups kept, the numerics change said, bad input refused."""

import pytest
import torch

import memfit
from memfit.techniques.low_bit_optimizer import is_low_bit, state_bytes
from tests.helpers import tiny, track_runner_step

pytest.importorskip("torchao.optim")
pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("state", ["8bit", "4bit", "bf16"])
def test_estimate_equals_the_fitted_runner_to_the_byte(state):
    model, batch = tiny("llama-1b")
    est = memfit.estimate(model, batch, optimizer="adamw", optimizer_state=state)
    t = track_runner_step(model, batch, "adamw", optimizer_state=state)
    assert (est.peak_bytes, est.breakdown, est.timeline) == (t.peak_bytes, t.breakdown, t.timeline)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert est.breakdown["optimizer"] == state_bytes(trainable, state)
    plain = memfit.estimate(model, batch, optimizer="adamw")
    assert est.breakdown["optimizer"] < plain.breakdown["optimizer"]


def test_fit_keeps_the_users_groups_and_says_the_numerics_change():
    model, batch = tiny("gpt2")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=3e-4, betas=(0.8, 0.9))
    runner = memfit.fit(model, opt, batch, optimizer_state="8bit")
    new = runner.optimizer
    assert is_low_bit(new) and new.is_adamw and runner.applied.optimizer_rebuilt
    assert [(g["weight_decay"], g["lr"], g["betas"]) for g in new.param_groups] == \
        [(0.1, 3e-4, (0.8, 0.9)), (0.0, 3e-4, (0.8, 0.9))]
    assert [g["params"] for g in new.param_groups] == [decay, rest]
    assert any("changes the numerics" in n for n in runner.applied.notes)
    before = decay[0].detach().clone()
    runner.step(batch)
    assert not torch.equal(before, decay[0])
    assert new.state[decay[0]]["state1"].dtype == torch.uint8      # bitsandbytes' codes


def test_composes_with_optimizer_offload():
    model, batch = tiny("gpt2")
    est = memfit.estimate(model, batch, optimizer="adamw", optimizer_state="4bit",
                          offload_optimizer=True)
    t = track_runner_step(model, batch, "adamw", optimizer_state="4bit", offload_optimizer=True)
    assert (est.peak_bytes, est.breakdown, est.host_peak_bytes) == \
        (t.peak_bytes, t.breakdown, t.host_peak_bytes)


def test_bad_input_is_refused_before_the_model_is_touched():
    model, batch = tiny("gpt2")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="SGD has no low-bit version.*Adam and AdamW"):
        memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                   optimizer_state="8bit")
    with pytest.raises(ValueError, match="SGD has no low-bit version"):
        memfit.estimate(model, batch, optimizer="sgd", optimizer_state="8bit")
    with pytest.raises(ValueError, match="optimizer_impl='foreach' has no effect"):
        memfit.estimate(model, batch, optimizer="adamw", optimizer_state="8bit",
                        optimizer_impl="foreach")
    with pytest.raises(ValueError, match="optimizer_state='2bit' is not one of"):
        memfit.estimate(model, batch, optimizer_state="2bit")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(not m._forward_pre_hooks for m in model.modules())
