"""trace.profile Note 6: the warm-up makes torch Adam/AdamW's state by ``_init_group`` alone.

Oracle: a real first ``step()`` of the same optimizer on a copy of the model, given the same
zero gradients: every state tensor of every parameter has the same key, shape, stride, dtype,
device and storage size. The warm-up ran no update where it took the short way (weight decay
leaves the parameters as they were), and a whole step where it cannot (a step hook, a subclass).
"""

import copy

import pytest
import torch
from torch import nn

from memfit.trace.profile import warm_up_optimizer


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    model[0].weight.data = model[0].weight.data.to(memory_format=torch.channels_last)
    return model


def _layout(opt, model):
    out = []
    for p in model.parameters():
        state = opt.state[p]
        out.append({k: (tuple(v.shape), v.stride(), v.dtype, v.device.type,
                        v.untyped_storage().nbytes()) for k, v in state.items()})
    return out


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.AdamW, {}),
    (torch.optim.AdamW, {"foreach": False}),
    (torch.optim.AdamW, {"fused": True}),
    (torch.optim.Adam, {"amsgrad": True}),
    (torch.optim.Adam, {"foreach": True, "maximize": True}),
])
def test_the_state_is_a_first_step_s(cls, kw):
    model, real = _model(), _model()
    opt = cls(model.parameters(), lr=0.1, weight_decay=0.5, **kw)
    ref = cls(real.parameters(), lr=0.1, weight_decay=0.5, **kw)
    before = copy.deepcopy(model.state_dict())
    warm_up_optimizer(model, opt)
    for p in real.parameters():
        p.grad = torch.zeros_like(p)
    ref.step()
    assert _layout(opt, model) == _layout(ref, real)
    for name, v in model.state_dict().items():                 # no update ran
        assert torch.equal(v, before[name])
    assert all(p.grad is not None for p in model.parameters())  # alive for the next step


class _OwnAdam(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("case", ["step hook", "subclass"])
def test_a_whole_step_runs_where_the_short_way_may_miss_something(case):
    model = _model()
    cls = _OwnAdam if case == "subclass" else torch.optim.AdamW
    opt = cls(model.parameters(), lr=0.1, weight_decay=0.5)
    calls = []
    if case == "step hook":
        opt.register_step_post_hook(lambda *a: calls.append(1))
    before = copy.deepcopy(model.state_dict())
    warm_up_optimizer(model, opt)
    changed = [not torch.equal(v, before[n]) for n, v in model.state_dict().items()]
    assert any(changed)                                          # the update ran
    assert calls == ([1] if case == "step hook" else [])


@pytest.mark.parametrize("grads_on_host", [False, True])
@pytest.mark.parametrize("inner", ["adamw", "for-loop"])
def test_an_offloaded_optimizer_s_state_is_a_first_step_s(grads_on_host, inner):
    """OffloadedOptimizer.first_step_state: the inner state on the host twins and the host
    gradients as a real first step leaves them (Note 6 inside: no update ran)."""
    from memfit.techniques.optimizer_offload import OptimizerOffload

    def build(params):
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.5,
                                 foreach=inner != "for-loop")

    made = []
    for _ in range(2):
        model = _model()
        opt = OptimizerOffload(OptimizerOffload.Config()).apply(model, build).optimizer
        if grads_on_host:
            opt.gradients_to_host()
        made.append((model, opt))
    (model, opt), (real, ref) = made
    before = [h.detach().clone() for h in opt.host_params]
    warm_up_optimizer(model, opt)
    for p in real.parameters():
        p.grad = torch.zeros_like(p)
    ref.step()
    assert _layout(opt.inner, nn.ParameterList(opt.host_params)) == \
        _layout(ref.inner, nn.ParameterList(ref.host_params))
    assert [h.grad is not None for h in opt.host_params] == \
        [h.grad is not None for h in ref.host_params] == [grads_on_host] * len(before)
    assert all(torch.equal(h, b) for h, b in zip(opt.host_params, before))   # no update
