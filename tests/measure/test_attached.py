"""measure.attached: what a tensor's attributes hold is its state, but not a fake's mode."""

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.measure.attached import attached, attached_tensors


def test_a_fake_tensor_s_mode_is_not_searched_for_state():
    mode = FakeTensorMode()
    mode.held_by_a_cache = torch.ones(3)        # a tensor the mode's own bookkeeping holds
    with mode:
        fake = torch.empty(4)
    seen = []
    got = attached(fake, lambda t: seen.append(t) or t)
    assert "fake_mode" not in got and seen == []
    assert list(attached_tensors(fake)) == []


def test_state_an_attribute_holds_is_still_found():
    class QuantState:
        def __init__(self):
            self.absmax = torch.ones(2)
            self.mode = FakeTensorMode()             # beside it, left alone

    p = nn.Parameter(torch.zeros(4), requires_grad=False)
    p.quant_state = QuantState()
    p.SCB = torch.ones(4)
    got = list(attached_tensors(p))
    assert [t.shape for t in got] == [torch.Size([2]), torch.Size([4])]
