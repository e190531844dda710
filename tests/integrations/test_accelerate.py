"""``integrations.accelerate``: estimate and fit for an Accelerate training loop (issue 12).

Oracles. ``estimate(accelerator, model, optimizer, batch)`` equals ``memfit.track`` of the same
real loop (``accelerator.prepare``, ``accumulate``, ``backward``, the prepared optimizer) over
three optimizer steps, the window on the third (steady state), to the byte: peak and breakdown.
After ``fit(..., budget)`` the real loop runs several steps under ``track(budget=...)`` without
raising (``OutOfMemory`` past it), the budget a fraction of the unplanned step's measured peak
(so the unplanned loop would not fit), and its losses are bitwise the unplanned run's (fit only
moved bytes: recompute, offload). The Accelerator is a process-wide singleton: reset around each
test as accelerate's own tests do.
"""

import weakref

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader
from transformers import default_data_collator

import memfit
from memfit.integrations import accelerate as mf_acc
from memfit.step import prepare_batch
from tests.helpers import tiny
from tests.integrations.hf_helpers import dataset_of

ARCHS = ["gpt2", "llama-1b"]
SETTINGS = {"fp32": dict(), "bf16": dict(mixed_precision="bf16"),
            "accumulation-2": dict(gradient_accumulation_steps=2)}


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def prepared(arch, batch_size=3, seq_len=16, **accelerator_kwargs):
    accelerator = Accelerator(cpu=True, **accelerator_kwargs)
    model, batch = tiny(arch, batch_size=batch_size, seq_len=seq_len)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, prepare_batch(batch)


def real_loop(accelerator, model, optimizer, batches, steps=3, max_grad_norm=None,
              budget=None, window=None):
    """The loop as users write it, ``steps`` optimizer steps over ``batches`` (cycled), under
    one track; the window opens at optimizer step ``window`` (1-based). Returns (track, the
    loss of every batch)."""
    g = accelerator.gradient_accumulation_steps
    losses = []
    with memfit.track(model, optimizer.optimizer, budget=budget) as t:
        for i in range(steps * g):
            if window is not None and i == (window - 1) * g:
                t.start_window()
            batch = batches[i % len(batches)]
            torch.manual_seed(i)                       # dropout draws alike in two runs
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if max_grad_norm is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return t, losses


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_estimate_equals_track_of_the_real_loop(arch, setting):
    accelerator, model, optimizer, batch = prepared(arch, **SETTINGS[setting])
    est = mf_acc.estimate(accelerator, model, optimizer, batch)
    assert accelerator.step == 0           # the loop's counters are put back
    t, _ = real_loop(accelerator, model, optimizer, [batch], window=3)
    assert est.peak_bytes == t.peak_bytes
    assert est.breakdown == t.breakdown


def test_estimate_of_a_list_of_micro_batches_with_clipping():
    """Two distinct micro-batches per step (all alive, as a list of batches is), the
    accelerator's clip_grad_norm_ on the syncing one, and bf16 autocast together."""
    accelerator, model, optimizer, _ = prepared("gpt2", mixed_precision="bf16",
                                                gradient_accumulation_steps=2)
    batches = [prepare_batch(tiny("gpt2", seed=s)[1]) for s in (1, 2)]
    est = mf_acc.estimate(accelerator, model, optimizer, batches, max_grad_norm=1.0)
    t, _ = real_loop(accelerator, model, optimizer, batches, max_grad_norm=1.0, window=3)
    assert est.peak_bytes == t.peak_bytes and est.breakdown == t.breakdown
    plain = mf_acc.estimate(accelerator, model, optimizer, batches)
    assert plain.timeline != est.timeline            # the clip is in the trace


def collate(rows):
    """transformers' collator, its tensors copied by an op: ``torch.tensor(list)`` runs below
    the dispatcher, so ``track`` would see a batch only at its first use."""
    return {k: v.clone() for k, v in default_data_collator(rows).items()}


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama-1b", marks=pytest.mark.slow)])
def test_estimate_of_a_prepared_dataloader_counts_its_look_ahead(arch):
    """The loop over ``accelerator.prepare(dataloader)`` (per-sample lists collated inside the
    run, accelerate's one-batch look-ahead): equal peak; the collated batches are born inside
    the measured run, so they are activations there and inputs in the trace. The look-ahead
    batch is used by no op of the step it is alive in, so the collator makes it with an op
    (``collate``) for ``track`` to see it born."""
    accelerator, model, optimizer, batch = prepared(arch, gradient_accumulation_steps=2)
    rows = dataset_of({k: v.repeat(8, *[1] * (v.dim() - 1)) for k, v in batch.items()})
    loader = accelerator.prepare(DataLoader(rows, batch_size=3, collate_fn=collate))
    est = mf_acc.estimate(accelerator, model, optimizer, loader)
    with memfit.track(model, optimizer.optimizer) as t:
        for i, batch in enumerate(loader):     # of 8 batches: 2 steps, the second counted
            if i == 2:
                t.start_window()
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if i == 3:
                break
    assert est.peak_bytes == t.peak_bytes
    assert sum(est.breakdown.values()) == sum(t.breakdown.values())
    one = mf_acc.estimate(accelerator, model, optimizer, batch)
    assert est.peak_bytes - one.peak_bytes == sum(v.nbytes for v in batch.values())


_EMAS = weakref.WeakKeyDictionary()


def test_estimate_of_the_users_own_loop_body():
    """``step=body``: the user's body inside ``accumulate`` (zero_grad after the forward, an
    EMA copy), equal to the same body in a real loop."""
    accelerator, model, optimizer, batch = prepared("llama-1b")

    def body(model, batch, optimizer):
        loss = model(**batch).loss
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        ema = _EMAS.get(model)
        if ema is None:
            ema = _EMAS[model] = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            torch._foreach_lerp_(ema, list(model.parameters()), 0.01)
        return loss

    est = mf_acc.estimate(accelerator, model, optimizer, batch, step=body)
    with memfit.track(model, optimizer.optimizer) as t:
        for i in range(3):
            if i == 2:
                t.start_window()
            with accelerator.accumulate(model):
                loss = body(model, batch, optimizer)
    assert est.peak_bytes == t.peak_bytes and est.breakdown == t.breakdown


FIT_SHAPE = dict(batch_size=4, seq_len=32)     # activations a fifth of the peak or more


def unplanned(arch, **accelerator_kwargs):
    """The unplanned loop's measured steady-state peak and its losses."""
    acc, model, optimizer, batch = prepared(arch, **FIT_SHAPE, **accelerator_kwargs)
    t, losses = real_loop(acc, model, optimizer, [batch], steps=3, window=2)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return t.peak_bytes, losses


def planned(arch, fraction, accelerator_kwargs=None, **fixed):
    peak, losses = unplanned(arch, **(accelerator_kwargs or {}))
    budget = int(peak * fraction)
    acc, model, optimizer, batch = prepared(arch, **FIT_SHAPE, **(accelerator_kwargs or {}))
    changes = mf_acc.fit(acc, model, optimizer, batch, budget, verbose=False, **fixed)
    assert changes.changed and changes.predicted_device_bytes <= budget < peak
    t, run = real_loop(acc, model, optimizer, [batch], steps=3, budget=budget)
    return changes, run, losses, (model, optimizer)


def test_fit_offloads_the_optimizer_and_the_loop_stays_in_budget_bitwise():
    changes, run, losses, (model, optimizer) = planned("gpt2", 0.8)
    assert changes.optimizer_offloaded
    assert type(optimizer.optimizer).__name__ == "OffloadedOptimizer"
    assert run == losses
    changes.remove()
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama-1b", marks=pytest.mark.slow)])
def test_fit_recomputes_blocks_and_the_loop_stays_in_budget_bitwise(arch):
    changes, run, losses, _ = planned(arch, 0.9, offload_optimizer=False)
    assert not changes.optimizer_offloaded
    assert any(m != "keep" for m in changes.blocks.values())
    assert run == losses


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama-1b", "bert-base"])
@pytest.mark.parametrize("setting", ["bf16", "accumulation-2"])
def test_fit_under_mixed_precision_and_accumulation_bitwise(arch, setting):
    # under accumulation the gradients are alive through the second forward and recompute
    # alone saves little: the budget leaves the optimizer's placement to memfit
    fixed = dict(offload_optimizer=False) if setting == "bf16" else {}
    fraction = 0.9 if setting == "bf16" else 0.8
    changes, run, losses, _ = planned(arch, fraction, SETTINGS[setting], **fixed)
    assert run == losses


def test_remove_takes_the_hooks_off():
    acc, model, optimizer, batch = prepared("gpt2", **FIT_SHAPE)
    before = mf_acc.estimate(acc, model, optimizer, batch)
    changes = mf_acc.fit(acc, model, optimizer, batch, int(before.peak_bytes * 0.9),
                         verbose=False, offload_optimizer=False)
    assert mf_acc.estimate(acc, model, optimizer, batch).peak_bytes < before.peak_bytes
    changes.remove()
    assert mf_acc.estimate(acc, model, optimizer, batch).peak_bytes == before.peak_bytes


@pytest.mark.slow          # each fit plans (traces its floor): ~12 s
def test_nothing_changes_when_it_fits():
    acc, model, optimizer, batch = prepared("gpt2")
    changes = mf_acc.fit(acc, model, optimizer, batch, "1GiB", verbose=False)
    assert not changes.changed and "nothing changed" in str(changes)


@pytest.mark.slow
def test_budget_too_small_names_the_floor():
    acc, model, optimizer, batch = prepared("gpt2")
    with pytest.raises(memfit.BudgetTooSmall) as e:
        mf_acc.fit(acc, model, optimizer, batch, 100_000, verbose=False)
    assert e.value.floor_bytes > 100_000


def test_bad_input_is_named():
    acc, model, optimizer, batch = prepared("gpt2", gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        mf_acc.estimate(acc, model, optimizer, [batch, batch, batch])
    with pytest.raises(ValueError, match="Mapping"):
        mf_acc.estimate(acc, model, optimizer, torch.zeros(3))
    with pytest.raises(ValueError, match="accelerator.prepare returned"):
        mf_acc.fit(acc, model, optimizer.optimizer, batch, "1GiB")
    with pytest.raises(ValueError, match="max_grad_norm with step"):
        mf_acc.estimate(acc, model, optimizer, batch, step=lambda m, b, o: None,
                        max_grad_norm=1.0)
