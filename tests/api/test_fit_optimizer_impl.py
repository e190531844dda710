"""``fit(..., optimizer_impl=...)`` applies the implementation the knob names (issue 11 item 13).

Oracle: the same model trained by a plain loop with ``AdamW(foreach=False)`` built by hand;
parameters after two steps must be bitwise equal, and ``runner.optimizer`` must run the
implementation asked for while the user's optimizer is left as it was.
"""

import copy

import pytest
import torch

import memfit
from memfit import zoo

SPEC = zoo.get("gpt2")


@pytest.mark.parametrize("impl,flags", [("foreach", (True, False)), ("fused", (False, True))])
def test_fit_rebuilds_the_optimizer_with_the_implementation(impl, flags):
    model = SPEC.build(tiny=True, seed=0).eval()          # no dropout: one RNG-free step
    reference = copy.deepcopy(model)
    batch = SPEC.make_batch(model, 2, seq_len=16)
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = memfit.fit(model, user, batch, optimizer_impl=impl)
    group = runner.optimizer.param_groups[0]
    assert (bool(group["foreach"]), bool(group.get("fused"))) == flags
    assert user.param_groups[0]["foreach"] is None            # the user's optimizer untouched
    assert runner.applied.optimizer_rebuilt and any(impl in n for n in runner.applied.notes)

    foreach, fused = flags
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=foreach, fused=fused)
    for _ in range(2):
        runner.step(batch)
        opt.zero_grad(set_to_none=True)
        reference(**batch).loss.backward()
        opt.step()
    for (n, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), n


def test_the_implementation_already_running_is_kept():
    """On CPU parameters a default AdamW already runs the for-loop: nothing is rebuilt."""
    model = SPEC.build(tiny=True, seed=0)
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = memfit.fit(model, user, SPEC.make_batch(model, 2, seq_len=16),
                        optimizer_impl="for-loop")
    assert runner.optimizer is user and not runner.applied.optimizer_rebuilt


def test_a_scheduler_on_an_optimizer_that_would_be_rebuilt_is_refused():
    model = SPEC.build(tiny=True, seed=0)
    user = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="scheduler=a factory"):
        memfit.fit(model, user, SPEC.make_batch(model, 2, seq_len=16), optimizer_impl="fused",
                   scheduler=torch.optim.lr_scheduler.StepLR(user, 10))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
