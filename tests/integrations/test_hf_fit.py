"""``integrations.transformers.fit(trainer, budget)``: after it, a real ``trainer.train()`` of
several steps runs under ``memfit.track(budget=...)`` from its first op to its last without
raising, and its per-step losses equal the unplanned run's (same seed): bitwise where fit only
moved bytes (recompute, offload of activations or of the optimizer state, fp32), within float
tolerance where it split the batch. The budgets are fractions of the unplanned step's measured
peak, so the unplanned run itself would not fit.
"""

import math

import pytest

import memfit
from memfit.integrations import transformers as mf_hf
from tests.integrations.hf_helpers import tiny_trainer, train_under

RUN = dict(per_device_train_batch_size=4, samples=48, max_steps=3, logging_strategy="steps",
           logging_steps=1)


def unplanned(name, **kw):
    """The unplanned run's peak (over the whole of train()) and per-step losses."""
    run = train_under(tiny_trainer(name, **(RUN | kw)))
    return run.peak_bytes, run.losses


def planned_run(name, fraction, **fixed):
    peak, losses = unplanned(name)
    budget = int(peak * fraction)
    trainer = tiny_trainer(name, **RUN)
    changes = mf_hf.fit(trainer, budget, verbose=False, **fixed)
    assert changes.changed and changes.predicted_device_bytes <= budget < peak
    run = train_under(trainer, budget=budget)        # raises OutOfMemory past the budget
    assert len(run.losses) == RUN["max_steps"]
    return changes, run, losses


def test_fit_offloads_the_optimizer_and_train_stays_in_budget_bitwise():
    changes, run, losses = planned_run("gpt2", 0.8)
    assert changes.optimizer_offloaded and changes.args == {}
    assert run.losses == losses


# budgets between the recomputed step (gpt2 0.875, llama 0.93 of the plain peak) and the plain
@pytest.mark.parametrize("name,fraction", [
    ("gpt2", 0.9), pytest.param("llama-1b", 0.95, marks=pytest.mark.slow)])
def test_fit_recomputes_blocks_and_train_stays_in_budget_bitwise(name, fraction):
    changes, run, losses = planned_run(name, fraction, micro_batch_size=4, offload_optimizer=False)
    assert not changes.optimizer_offloaded
    assert any(m != "keep" for m in changes.blocks.values()) or \
        changes.args.get("activation_checkpointing") == (False, True)
    assert run.losses == losses


def test_fit_splits_the_batch_and_losses_match_within_tolerance():
    # llama has no dropout: another split draws no other masks, only sums in another order
    changes, run, losses = planned_run("llama-1b", 0.95, micro_batch_size=1,
                                       offload_optimizer=False)
    assert changes.args["per_device_train_batch_size"] == (4, 1)
    assert changes.args["gradient_accumulation_steps"] == (1, 4)
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(run.losses, losses))


def test_nothing_to_change_when_it_fits():
    trainer = tiny_trainer("gpt2", **RUN)
    changes = mf_hf.fit(trainer, "1GiB", verbose=False)
    assert not changes.changed and "nothing changed" in str(changes)


def test_a_fixed_choice_is_applied_even_when_the_trainer_fits():
    trainer = tiny_trainer("gpt2", **RUN)
    changes = mf_hf.fit(trainer, "1GiB", verbose=False, offload_optimizer=True)
    assert changes.optimizer_offloaded and changes.args == {}


def test_budget_too_small_names_the_floor():
    trainer = tiny_trainer("gpt2", **RUN)
    with pytest.raises(memfit.BudgetTooSmall) as e:
        mf_hf.fit(trainer, 100_000, verbose=False, micro_batch_size=4, offload_optimizer=True)
    assert e.value.floor_bytes > 100_000


def test_estimate_after_fit_and_remove_puts_everything_back():
    trainer = tiny_trainer("gpt2", **RUN)
    peak = mf_hf.estimate(trainer).peak_bytes
    changes = mf_hf.fit(trainer, int(peak * 0.7), verbose=False, offload_optimizer=True)
    assert mf_hf.estimate(trainer).peak_bytes == changes.predicted_peak_bytes   # the fitted one
    changes.remove()
    assert trainer.optimizer is None and trainer.args.per_device_train_batch_size == 4
    assert mf_hf.estimate(trainer).peak_bytes == peak


def test_fixed_choices_are_checked():
    trainer = tiny_trainer("gpt2", **RUN)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        mf_hf.fit(trainer, "1MiB", micro_batch_size=3)
