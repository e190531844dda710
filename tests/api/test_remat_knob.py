"""The remat knob: fit(remat=True) trains bitwise like the plain runner where the plain one
cannot fit."""

import pytest
import torch

import memfit
from memfit.knobs import NOT_YET, Knobs
from tests.techniques.test_remat import build, plain_peak


def _runner(remat):
    model, batch = build("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return memfit.fit(model, opt, batch, remat=remat), batch


def test_fit_with_remat_steps_under_a_budget_the_plain_runner_cannot_meet():
    plain, batch = _runner(None)
    budget = plain_peak(plain.model, batch) * 6 // 10
    dtr, _ = _runner(True)
    assert any("remat" in r for r in dtr.applied.notes)     # the plan itself is immutable
    for seed in (1, 2):
        torch.manual_seed(seed)
        plain.step(batch)                               # unbudgeted reference
        torch.manual_seed(seed)
        with memfit.track(dtr.model, dtr.optimizer, budget=budget) as t:
            dtr.step(batch)                             # remat evicts on track's OutOfMemory
        assert t.peak_bytes <= budget
    assert all(torch.equal(p, q) for p, q in zip(plain.model.parameters(), dtr.model.parameters()))
    with pytest.raises(memfit.OutOfMemory):
        with memfit.track(plain.model, plain.optimizer, budget=budget):
            plain.step(batch)
    assert all("forward" not in vars(m) for m in dtr.model.modules())   # only inside a step


def test_remat_is_available():
    assert "remat" not in NOT_YET
    Knobs(remat=True).check_available()
