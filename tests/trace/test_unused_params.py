"""A parameter the step gives no gradient (the loss does not reach it) has no gradient in the
trace's warm-up, nor optimizer state, as in a real step (trace.profile Note 4). Before, the
warm-up gave every trainable parameter both: this model's estimate was three times its step."""

import pytest
import torch
from torch import nn

import memfit
from memfit.step import canonical_step


class UsedAndUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(64, 64)
        self.unused = nn.Linear(256, 256)      # never called: LED's global projections, etc.

    def forward(self, x):
        return self.used(x).square().sum()


def _real_second_step(model, x) -> int:
    """The peak of a real second step (memfit's own: its loss is kept to the end), measured
    by ``track``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        canonical_step(model, opt, x, loss_fn=lambda m, b: m(b))
    step()
    assert model.unused.weight.grad is None and model.unused.weight not in opt.state  # premise
    with memfit.track(model, opt) as t:
        step()
    return t.peak_bytes


def _job(model, x):
    return memfit.Job(model, x, optimizer="adamw", loss_fn=lambda m, b: m(b))


def test_a_parameter_the_loss_does_not_reach_has_no_gradient_nor_state():
    torch.manual_seed(0)
    model, x = UsedAndUnused(), torch.randn(8, 64)
    est = memfit.estimate(_job(model, x), device="cpu")
    assert est.peak_bytes == _real_second_step(model, x)
    # AdamW's two moments and a step counter (a 4-byte tensor) per parameter it steps
    assert est.breakdown["optimizer"] == sum(2 * p.numel() * 4 + 4 for p in model.used.parameters())


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_every_warm_up_leaves_it_without(precision):
    """The one-step trace (its warm-up: fp16's with the scaler) and the two-step one (a GPU's
    allocator replay, whose first step is real) agree on the state."""
    torch.manual_seed(0)
    model, x = UsedAndUnused(), torch.randn(8, 64)
    job = _job(model, x)
    one = memfit.estimate(job, device="gtx-1080-ti", precision=precision, allocator_replay=False)
    two = memfit.estimate(job, device="gtx-1080-ti", precision=precision)
    state = sum(2 * p.numel() * 4 for p in model.used.parameters())   # step counters: host
    assert one.breakdown["optimizer"] == two.breakdown["optimizer"] == state
