"""Optimizers memfit cannot step or trace are refused with the fix, before any trace (issue 26's
newcomer pass: LBFGS stopped in a raw TypeError, SparseAdam in a raw RuntimeError)."""

import pytest
import torch
from torch import nn

import memfit

LOSS = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])     # noqa: E731


def _job():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    return model, (torch.randn(8, 32), torch.randint(0, 4, (8,)))


@pytest.mark.parametrize("make, words", [
    (lambda ps: torch.optim.LBFGS(ps), "needs a closure"),
    (lambda ps: torch.optim.SparseAdam(list(ps)), "SparseAdam"),
])
def test_refused_with_the_fix_and_the_model_untouched(make, words):
    model, batch = _job()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=words) as info:
        memfit.estimate(model, batch, optimizer=make(model.parameters()), loss_fn=LOSS)
    assert "AdamW" in str(info.value)
    with pytest.raises(ValueError, match=words):
        memfit.fit(model, make(model.parameters()), batch, budget="1GiB", loss_fn=LOSS).step(batch)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_factory_of_a_bitsandbytes_optimizer_is_estimated_as_its_instance():
    """``optimizer=lambda ps: bnb.optim.AdamW8bit(ps)``: its constructor reads its maps' values,
    which a fake cannot (a raw DataDependentOutputException before); it is built with the modes
    set aside and rebuilt as an instance is (_bnb_optimizer BnbRecipe)."""
    bnb = pytest.importorskip("bitsandbytes")
    model, batch = _job()
    made = memfit.estimate(model, batch, loss_fn=LOSS,
                           optimizer=lambda ps: bnb.optim.AdamW8bit(ps, min_8bit_size=64))
    given = memfit.estimate(model, batch, loss_fn=LOSS,
                            optimizer=bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=64))
    assert made.peak_bytes == given.peak_bytes and made.breakdown == given.breakdown
    # by hand: 8-bit codes + an fp32 absmax per 256 values for the two weights (>= 64 values),
    # fp32 moments for the biases, bitsandbytes' two 256-value fp32 maps once
    hand = sum(2 * (p.numel() + 4 * -(-p.numel() // 256)) if p.numel() >= 64 else 8 * p.numel()
               for p in model.parameters()) + 2 * 256 * 4
    assert made.breakdown["optimizer"] == hand
