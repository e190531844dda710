"""``plan(step=fn)`` and ``fit(step=fn)``: the plan reaches the user's step through the model and
the optimizer, the real step then fits its budget, and the math does not change (issue 12).

Oracles: ``memfit.track(budget=...)`` raises past the budget (so a run that returns fits); the
measured peak equals the plan's prediction to the byte (a CPU trace is exact); gradients and
parameters after several steps are bitwise equal to the same step run without memfit, with the
same seeds (dropout included).
"""

import copy

import pytest
import torch

import memfit
from memfit.step import prepare_batch
from tests.api.test_user_step import step_after, step_before, step_clip_ema, step_lr
from tests.helpers import tiny

STEPS = 3


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def run_plain(model, batch, fn, scheduler=None, optimizer=adamw):
    """The user's loop without memfit: the reference."""
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if scheduler else None
    losses = []
    for i in range(STEPS):
        torch.manual_seed(i)
        losses.append(float(fn(model, batch, opt)))
        if sched is not None:
            sched.step()
    return losses


def run_fitted(model, batch, fn, budget=None, scheduler=None, optimizer=adamw, **knobs):
    opt = optimizer(model.parameters())
    runner = memfit.fit(model, opt, batch, budget, device="cpu", step=fn, scheduler=scheduler,
                        **knobs)
    losses = []
    with memfit.track(runner.model, runner.optimizer, budget=budget) as t:
        for i in range(STEPS):
            torch.manual_seed(i)
            losses.append(runner.step(batch))
    runner.close()
    return runner, t, losses


def assert_same_training(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or
                                                         torch.equal(p.grad, q.grad)), name


@pytest.mark.slow
@pytest.mark.parametrize("fn", [step_before, step_after], ids=lambda f: f.__name__)
def test_planned_user_step_fits_and_trains_the_same(fn):
    model, batch = tiny("gpt2")
    batch = prepare_batch(batch)
    plain = memfit.estimate(model, batch, optimizer="sgd", step=fn)
    budget = int(plain.peak_bytes * 0.95)     # SGD has no state: only the blocks can give
    ref = copy.deepcopy(model)
    runner, t, losses = run_fitted(model, batch, fn, budget, optimizer=sgd)
    plan = runner.plan
    assert any(m != "keep" for m in plan.blocks.values())     # the budget forced a change
    assert plan.knobs.precision is None and plan.knobs.micro_batch_size is None
    assert any("step=fn" in r for r in plan.reasons)
    assert any("no re-plan" in n for n in runner.applied.notes)
    assert t.peak_bytes <= budget
    assert t.peak_bytes == plan.predicted_peak_bytes
    assert losses == run_plain(ref, batch, fn, optimizer=sgd)
    assert_same_training(model, ref)


@pytest.mark.slow
@pytest.mark.parametrize("knobs", [{"checkpoint": "all"}, {"checkpoint": "selective"},
                                   {"offload": "all"}, {"offload_optimizer": True}],
                         ids=lambda k: "-".join(f"{a}={v}" for a, v in k.items()))
def test_fixed_techniques_reach_the_step_and_keep_the_math(knobs):
    """Clipping, a scheduler and an EMA copy, with each technique applied through the model
    (block hooks) or the optimizer (offloaded state); estimate equals the measured run."""
    model, batch = tiny("llama-1b")
    batch = prepare_batch(batch)
    ref = copy.deepcopy(model)
    est = memfit.estimate(model, batch, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                          step=step_clip_ema, scheduler=step_lr, **knobs)
    runner, t, losses = run_fitted(model, batch, step_clip_ema, scheduler=step_lr, **knobs)
    assert t.peak_bytes == est.peak_bytes    # steps 2 and 3 are the steady state traced
    assert losses == run_plain(ref, batch, step_clip_ema, step_lr)
    assert_same_training(model, ref)
    plain = memfit.estimate(ref, batch, optimizer="adamw", step=step_clip_ema, scheduler=step_lr)
    if "checkpoint" in knobs:       # the blocks kept less for their backward
        assert set(est.knobs_blocks.values()) == {knobs["checkpoint"].replace("all", "recompute")}
        assert est.peak_bytes < plain.peak_bytes
    else:                           # bytes left the device
        assert est.host_peak_bytes > 0 == plain.host_peak_bytes


def test_fit_user_step_returns_the_loss_and_steps_the_scheduler():
    model, batch = tiny("bert-base")
    batch = prepare_batch(batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    runner = memfit.fit(model, opt, batch, step=step_before, scheduler=step_lr)
    loss = runner.step(batch)
    assert isinstance(loss, float) and loss == runner.last_step.loss
    assert runner.optimizer.param_groups[0]["lr"] == 0.5


def test_user_step_returning_none_gives_nan():
    model, batch = tiny("gpt2")

    def quiet(model, batch, optimizer):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()

    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=quiet)
    assert runner.step(batch) != runner.step(batch)        # NaN
