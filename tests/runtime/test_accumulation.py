"""One Runner step with micro-batches equals one full-batch step (SGD, so a gradient-scale
error cannot hide behind Adam's normalisation)."""

import pytest
import torch
from torch import nn

import memfit
from memfit.step import canonical_step, prepare_batch
from tests.helpers import tiny, track_next_run


def updates(model, run):
    """Parameter updates of one step made by ``run`` (returns the deltas, by name)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    run()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def full_batch_updates(arch, batch, lr=1.0):
    model, _ = tiny(arch)
    model.eval()                                  # no dropout: micro-batches draw other masks
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return updates(model, lambda: canonical_step(model, opt, prepare_batch(batch)))


def runner_updates(arch, batch, lr=1.0, **kw):
    model, _ = tiny(arch)
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    runner = memfit.fit(model, opt, batch, **kw)
    out = updates(model, lambda: runner.step(batch))
    return out, runner


def max_error(a, b):
    largest = max(v.abs().max().item() for v in b.values())
    return max((a[n] - b[n]).abs().max().item() for n in a) / largest


@pytest.mark.parametrize("arch,padded,mbs", [
    ("gpt2", True, 2),          # causal LM, rows of different lengths: counts differ per micro
    ("gpt2", True, 3),          # 3 does not divide 8: the last micro-batch is smaller
    ("llama-1b", True, 1),
    ("bert-base", False, 2),    # classifier: counts samples
])
def test_accumulation_equals_the_full_batch(arch, padded, mbs):
    _, batch = tiny(arch, batch_size=8, seq_len=12, padded=padded)
    full = full_batch_updates(arch, batch)
    acc, runner = runner_updates(arch, batch, micro_batch_size=mbs)
    assert max_error(acc, full) < 1e-5
    assert runner.last_step.micro_batches == -(-8 // mbs)
    labels = batch["labels"]
    expected_items = int((labels[:, 1:] != -100).sum()) if arch != "bert-base" else 8
    assert runner.last_step.items == expected_items


def test_negative_control_per_micro_batch_mean_is_detected():
    """Averaging per-micro-batch means (every micro-batch weighs the same) is the classic bug;
    the same check must catch it on padded causal-LM batches."""
    _, batch = tiny("gpt2", batch_size=8, seq_len=12, padded=True)
    full = full_batch_updates("gpt2", batch)
    wrong, _ = runner_updates("gpt2", batch, micro_batch_size=2, count_fn=lambda mb: 1)
    assert max_error(wrong, full) > 1e-3


def test_returned_loss_is_the_full_batch_loss():
    _, batch = tiny("gpt2", batch_size=8, seq_len=12, padded=True)
    model, _ = tiny("gpt2")
    model.eval()
    with torch.no_grad():
        expected = model(**batch).loss.item()
    _, runner = runner_updates("gpt2", batch, micro_batch_size=3)
    assert runner.last_step.loss == pytest.approx(expected, rel=1e-6)


def test_fp16_inf_in_one_micro_batch_skips_the_whole_step_and_halves_the_scale_once():
    model, batch = tiny("bert-base", batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = memfit.fit(model, opt, batch, precision="fp16", micro_batch_size=1)
    runner.step(batch)
    scale = runner.scaler.get_scale()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poisoned = 0

    def poison(module, args, out):          # an inf in the 3rd of 4 micro-batches only
        nonlocal poisoned
        poisoned += 1
        return out * float("inf") if poisoned == 3 else out

    handle = model.bert.embeddings.register_forward_hook(poison)
    runner.step(batch)
    handle.remove()
    assert runner.last_step.skipped
    assert runner.scaler.get_scale() == scale * 0.5            # halved once, not per micro
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    runner.step(batch)
    assert not runner.last_step.skipped


def test_scheduler_steps_once_per_effective_batch():
    model, batch = tiny("bert-base", batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    runner = memfit.fit(model, opt, batch, micro_batch_size=1, scheduler=sched)
    runner.step(batch)
    runner.step(batch)
    assert opt.param_groups[0]["lr"] == 0.25


def test_clipping_reports_the_norm_before_clipping():
    model, batch = tiny("bert-base", batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    runner = memfit.fit(model, opt, batch, micro_batch_size=2, max_grad_norm=1e-3)
    runner.step(batch)
    assert runner.last_step.grad_norm > 1e-3
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert norm.item() == pytest.approx(1e-3, rel=1e-4)


def test_batchnorm_warns_that_accumulation_cannot_be_exact():
    model, batch = tiny("resnet-50", batch_size=4)
    with pytest.warns(UserWarning, match="BatchNorm"):
        memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, micro_batch_size=2)


def test_plain_fit_is_the_plain_step():
    _, batch = tiny("gpt2", batch_size=4, padded=True)
    full = full_batch_updates("gpt2", batch, lr=0.5)
    plain, runner = runner_updates("gpt2", batch, lr=0.5)
    assert all(torch.equal(plain[n], full[n]) for n in plain)      # bitwise: same ops
    assert runner.plan.knobs.precision == "fp32" and runner.last_step.micro_batches == 1


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_budget_with_only_micro_batching_left_picks_the_fewest_micro_batches():
    """With recompute, offload and optimizer offload fixed off, the planner's one lever is the
    micro-batch: the fastest plan runs the fewest micro-batches whose (exact, CPU) estimate
    fits, and among sizes giving that count the smallest (least memory, even chunks)."""
    model, batch = tiny("gpt2", batch_size=8, seq_len=32)
    peaks = {m: memfit.estimate(model, batch, "sgd", micro_batch_size=m).peak_bytes
             for m in range(1, 9)}
    assert peaks[1] < peaks[2] < peaks[4] < peaks[8]
    budget = (peaks[4] + peaks[8]) // 2
    # runner.step(batch) also holds the caller's all-ones mask, which the step itself drops
    held = batch["attention_mask"].nbytes
    peaks = {m: p + held for m, p in peaks.items()}
    fitting = [m for m, p in peaks.items() if p <= budget]
    fewest = min(-(-8 // m) for m in fitting)
    expected = min(m for m in fitting if -(-8 // m) == fewest)
    off = dict(checkpoint="none", offload="none", offload_optimizer=False)
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, budget=budget,
                        **off)
    assert runner.plan.knobs.micro_batch_size == expected
    assert runner.plan.predicted_peak_bytes == peaks[expected] <= budget
    assert any("micro-batch" in r for r in runner.plan.reasons)
    with memfit.track(model, runner.optimizer, budget=budget):
        runner.step(batch)                 # never crosses the budget
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                   budget=peaks[1] // 2, **off)
    assert info.value.floor_bytes == min(peaks[1], peaks[8])


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch,mbs", [("gpt2", 2), ("bert-base", 3), ("t5-base", 2)])
def test_estimate_equals_track_for_micro_batched_steps(arch, mbs, precision):
    model, batch = tiny(arch, batch_size=6, padded=True)
    est = memfit.estimate(model, batch, "adamw", precision=precision, micro_batch_size=mbs)
    opt = torch.optim.AdamW(model.parameters())
    runner = memfit.fit(model, opt, batch, precision=precision, micro_batch_size=mbs)
    t = track_next_run(runner, batch)
    assert est.peak_bytes == t.peak_bytes and est.breakdown == t.breakdown


def test_bad_input():
    model, batch = tiny("bert-base", batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="micro_batch_size"):
        memfit.fit(model, opt, batch, micro_batch=2)
    with pytest.raises(ValueError, match="positive int"):
        memfit.fit(model, opt, batch, micro_batch_size=0)
    with pytest.raises(ValueError, match="batch dimension"):
        lin = nn.Linear(2, 2)
        memfit.fit(lin, torch.optim.SGD(lin.parameters(), lr=0.1), {"x": torch.tensor(1.0)},
                   loss_fn=lambda m, b: b["x"])
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    runner = memfit.fit(model, opt, batch)
    with pytest.raises(ValueError, match="labels"):
        runner.step(no_labels)
    with pytest.raises(ValueError, match="fp16"):
        memfit.fit(model, opt, batch, device="gtx-1080-ti", precision="bf16")
    with pytest.raises(ValueError, match="remat must be True or False"):
        memfit.fit(model, opt, batch, remat="yes")
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="not trainable parameters"):
        memfit.fit(model, other, batch)


def test_a_micro_batch_with_nothing_to_count_reports_zero_not_nan():
    model, batch = tiny("gpt2", batch_size=2, seq_len=8)
    batch["labels"][1] = -100                      # the second micro-batch counts no token
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                        micro_batch_size=1)
    loss = runner.step(batch)
    assert loss == loss and runner.last_step.items == 7      # not NaN; 7 shifted labels
    assert all(torch.isfinite(p).all() for p in model.parameters())
