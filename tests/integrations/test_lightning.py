"""``integrations.lightning``: estimate and the ``MemfitPlan`` callback for a real
``lightning.Trainer`` on CPU (issue 12).

Oracles. ``estimate(module, batch, ...)`` equals the peak ``memfit.track`` measures over a
steady-state optimizer step of a real ``Trainer.fit`` (step 2, from the ``on_train_batch_start``
of its first batch to the ``on_train_batch_end`` of its last; the track opened at
``on_train_start``, so everything the loop makes is counted from its birth), to the byte. The
batches come from a real DataLoader with transformers' collator over per-sample lists (so the
collated batch is born inside the run, as in real training). With ``MemfitPlan(budget)`` a real
``fit`` runs under ``track(budget=...)`` without raising (the budget a fraction of the unplanned
step's measured peak, so the unplanned run would not fit), and its per-batch losses are bitwise
the unplanned run's (recompute and offload only move bytes).
"""

import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import default_data_collator

import memfit
from memfit.integrations import lightning as mf_pl
from memfit.step import prepare_batch
from tests.helpers import tiny
from tests.integrations.hf_helpers import dataset_of

ARCHS = ["gpt2", "llama-1b"]


class Wrapped(L.LightningModule):
    """A tiny HF model as users wrap one."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Measure(L.Callback):
    """A track from ``on_train_start`` (with ``budget``, over the whole run); the peak of
    optimizer step ``step`` and every batch's loss."""

    def __init__(self, accumulate=1, step=2, budget=None):
        self.g, self.step, self.budget = accumulate, step, budget
        self.tracker, self.peak_bytes, self.breakdown, self.losses = None, None, None, []

    def on_train_start(self, trainer, pl_module):
        self.tracker = memfit.track(pl_module, trainer.optimizers[0], budget=self.budget)
        self.tracker.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == (self.step - 1) * self.g and self.budget is None:
            self.tracker.start_window()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())
        if batch_idx == self.step * self.g - 1 and self.budget is None:
            self.close()

    def on_train_end(self, trainer, pl_module):
        self.close()

    def close(self):
        if self.tracker is not None:
            t, self.tracker = self.tracker, None
            t.__exit__(None, None, None)
            self.peak_bytes, self.breakdown = t.peak_bytes, t.breakdown


def setup(arch, batch_size=3, seq_len=16, samples=24):
    model, batch = tiny(arch, batch_size=batch_size, seq_len=seq_len)
    batch = prepare_batch(batch)                # no all-ones mask: the run's batches have none
    rows = dataset_of({k: v.repeat(samples // batch_size, *[1] * (v.dim() - 1))
                       for k, v in batch.items()})
    loader = DataLoader(rows, batch_size=batch_size, collate_fn=default_data_collator)
    return Wrapped(model), batch, loader


def fit(module, loader, callbacks, max_steps=3, **trainer_kwargs):
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, **trainer_kwargs)
    torch.manual_seed(0)                        # dropout draws alike in two runs
    trainer.fit(module, loader)
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_estimate_equals_the_measured_steady_state_step(arch, accumulate):
    module, batch, loader = setup(arch)
    est = mf_pl.estimate(module, batch, accumulate_grad_batches=accumulate)
    m = Measure(accumulate)
    fit(module, loader, [m], accumulate_grad_batches=accumulate)
    assert est.peak_bytes == m.peak_bytes
    # the collated batch is born inside the measured run (activations/temporaries there), the
    # traced one is given (inputs): every other category is equal
    for k in ("params", "grads", "optimizer", "other"):
        assert est.breakdown[k] == m.breakdown[k], k
    assert sum(est.breakdown.values()) == sum(m.breakdown.values())


class Stream(torch.utils.data.IterableDataset):
    """The same rows without a length: Lightning's fetcher then reads one batch ahead."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def collate(rows):
    """transformers' collator, its tensors copied by an op: ``torch.tensor(list)`` runs below
    the dispatcher, so ``track`` would see a batch only at its first use (never, for the
    look-ahead batch of a step)."""
    return {k: v.clone() for k, v in default_data_collator(rows).items()}


@pytest.mark.slow
def test_estimate_counts_the_look_ahead_of_an_unsized_loader():
    module, batch, loader = setup("gpt2")
    stream = DataLoader(Stream(loader.dataset), batch_size=3, collate_fn=collate)
    est = mf_pl.estimate(module, batch, accumulate_grad_batches=2, look_ahead=True)
    m, cb = Measure(2), mf_pl.MemfitPlan(steps=2)    # the callback finds the loader unsized
    fit(module, stream, [m, cb], accumulate_grad_batches=2)
    assert est.peak_bytes == m.peak_bytes
    assert cb.predicted_peak_bytes == est.peak_bytes == cb.records[1].measured_peak_bytes
    plain = mf_pl.estimate(module, batch, accumulate_grad_batches=2)
    assert est.peak_bytes - plain.peak_bytes == sum(v.nbytes for v in batch.values())


def test_estimate_with_clipping_and_bf16_equals_the_measured_step():
    module, batch, loader = setup("gpt2")
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=1.0, precision="bf16-mixed")
    est = mf_pl.estimate(module, batch, **kw)
    m = Measure(2)
    fit(module, loader, [m], **kw)
    assert est.peak_bytes == m.peak_bytes


def test_callback_logs_predicted_equal_to_measured_and_stays_quiet():
    module, _, loader = setup("gpt2")
    cb = mf_pl.MemfitPlan(steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(LeafSpec|loss_type|num_workers).*")
        fit(module, loader, [cb], max_steps=4, accumulate_grad_batches=2)
    assert [r.step for r in cb.records] == [1, 2, 3]
    assert all(r.measured_peak_bytes == cb.predicted_peak_bytes for r in cb.records[1:])
    assert cb.changes is None


def test_callback_warns_when_the_prediction_is_off():
    module, batch, loader = setup("gpt2")
    small = {k: v[:1] for k, v in batch.items()}          # traced on 1 sample, run on 3
    cb = mf_pl.MemfitPlan(batch=small, steps=2)
    with pytest.warns(UserWarning, match="differs from memfit's prediction"):
        fit(module, loader, [cb])


def unplanned(arch):
    module, _, loader = setup(arch, **FIT_SHAPE)
    m = Measure()
    fit(module, loader, [m])
    losses = Measure(budget=10**12)
    module, _, loader = setup(arch, **FIT_SHAPE)
    fit(module, loader, [losses])
    return m.peak_bytes, losses.losses


FIT_SHAPE = dict(batch_size=4, seq_len=32)      # activations a fifth of the peak or more


def planned_run(arch, fraction, **fixed):
    peak, losses = unplanned(arch)
    budget = int(peak * fraction)
    module, _, loader = setup(arch, **FIT_SHAPE)
    plan = mf_pl.MemfitPlan(budget, verbose=False, **fixed)
    run = Measure(budget=budget)                   # raises OutOfMemory past the budget
    trainer = fit(module, loader, [plan, run])
    assert plan.changes.changed and plan.changes.predicted_device_bytes <= budget < peak
    assert len(run.losses) == 3
    return plan, run, losses, trainer


@pytest.mark.slow
def test_planned_fit_offloads_the_optimizer_in_budget_bitwise():
    plan, run, losses, trainer = planned_run("gpt2", 0.8)
    assert plan.changes.optimizer_offloaded
    assert type(trainer.optimizers[0]).__name__ == "OffloadedOptimizer"
    assert run.losses == losses
    plan.changes.remove()
    assert isinstance(trainer.optimizers[0], torch.optim.AdamW)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama-1b", marks=pytest.mark.slow)])
def test_planned_fit_recomputes_in_budget_bitwise(arch):
    plan, run, losses, _ = planned_run(arch, 0.9, offload_optimizer=False)
    assert any(m != "keep" for m in plan.changes.blocks.values())
    assert run.losses == losses


def test_bad_input_is_named():
    module, batch, _ = setup("gpt2")
    with pytest.raises(ValueError, match="32-true"):
        mf_pl.estimate(module, batch, precision="16-mixed")
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        mf_pl.estimate(module, batch, accumulate_grad_batches=0)
    with pytest.raises(ValueError, match="LightningModule"):
        mf_pl.estimate(module.model, batch)
    with pytest.raises(ValueError, match="steps"):
        mf_pl.MemfitPlan(steps=1)
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="manual optimization"):
        mf_pl.estimate(module, batch)
