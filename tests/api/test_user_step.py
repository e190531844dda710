"""``estimate(step=fn)`` equals ``track`` of the same real step to the byte (issue 12).

The oracle: the real model, a real optimizer and the user's ``fn``, two real steps under one
``memfit.track`` with the window on the second (``start_window``), exactly the steady state the
trace counts (api._user_step Note 2). Four loop styles on three architectures.
"""

import weakref

import pytest
import torch

import memfit
from memfit.step import prepare_batch
from tests.helpers import tiny

ARCHS = ["gpt2", "bert-base", "llama-1b"]


def step_before(model, batch, optimizer):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


def step_after(model, batch, optimizer):
    loss = model(**batch).loss
    optimizer.zero_grad()          # last step's gradients were alive through the forward
    loss.backward()
    optimizer.step()
    return loss


def step_keep_buffers(model, batch, optimizer):
    optimizer.zero_grad(set_to_none=False)      # the gradient buffers are never freed
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()


_EMAS = weakref.WeakKeyDictionary()      # model -> its EMA weights (state kept between calls)


def step_clip_ema(model, batch, optimizer):
    params = [p for p in model.parameters() if p.requires_grad]
    ema = _EMAS.get(model)
    if ema is None:
        ema = _EMAS[model] = [p.detach().clone() for p in params]
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    with torch.no_grad():
        torch._foreach_lerp_(ema, params, 0.01)
    return loss


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


STYLES = {"before-forward": (step_before, None), "after-forward": (step_after, None),
          "keep-buffers": (step_keep_buffers, None), "clip+scheduler+ema": (step_clip_ema, step_lr)}


def track_two_steps(model, batch, fn, optimizer, scheduler=None):
    """Two real steps under one track, the second windowed (the oracle)."""
    with memfit.track(model, optimizer) as t:
        for i in range(2):
            if i == 1:
                t.start_window()
            fn(model, batch, optimizer)
            if scheduler is not None:
                scheduler.step()
    return t


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("style", list(STYLES))
def test_user_step_estimate_equals_track(arch, style):
    fn, sched = STYLES[style]
    model, batch = tiny(arch)
    batch = prepare_batch(batch)   # no all-ones mask: see test_all_ones_mask_is_kept_for_the_step
    est = memfit.estimate(model, batch, optimizer="adamw", step=fn, scheduler=sched)
    opt = torch.optim.AdamW(model.parameters())
    t = track_two_steps(model, batch, fn, opt, sched and sched(opt))
    assert est.peak_bytes == t.peak_bytes
    assert est.breakdown == t.breakdown
    if fn is not step_clip_ema:
        # clip_grad_norm_ takes its foreach path only for plain tensors (torch's
        # _foreach_supported_types), so on fakes it runs one norm per gradient: same bytes,
        # other ops
        assert est.timeline == t.timeline
    assert set(est.phases) == {"forward", "backward", "optimizer"}
    assert est.phases["forward"] < est.phases["backward"] < est.phases["optimizer"]


_SCALERS = weakref.WeakKeyDictionary()      # optimizer -> its GradScaler


def step_fp16_scaler(model, batch, optimizer):
    scaler = _SCALERS.setdefault(optimizer, torch.amp.GradScaler("cpu"))
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)          # reads the inf check back: trace.finite_grads
    scaler.update()
    return loss


def step_two_losses(model, batch, optimizer):
    """Two forwards (e.g. a consistency loss) and a second loss on the logits."""
    optimizer.zero_grad()
    first = model(**batch)
    second = model(**batch)
    loss = first.loss + 0.1 * (first.logits - second.logits).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("arch", ARCHS)
def test_a_real_grad_scaler_in_the_step(arch):
    model, batch = tiny(arch)
    batch = prepare_batch(batch)
    est = memfit.estimate(model, batch, optimizer="adamw", step=step_fp16_scaler)
    t = track_two_steps(model, batch, step_fp16_scaler, torch.optim.AdamW(model.parameters()))
    assert est.peak_bytes == t.peak_bytes and est.breakdown == t.breakdown


def test_extra_forward_and_second_loss():
    model, batch = tiny("gpt2")
    batch = prepare_batch(batch)
    est = memfit.estimate(model, batch, optimizer="adamw", step=step_two_losses)
    t = track_two_steps(model, batch, step_two_losses, torch.optim.AdamW(model.parameters()))
    assert est.peak_bytes == t.peak_bytes and est.breakdown == t.breakdown
    assert est.timeline == t.timeline


def test_user_step_on_a_gpu_target_is_the_canonical_one():
    """The same loop written by the user and memfit's own give the same CUDA-model figures
    (replay, reserved bytes and all), in both zero_grad styles."""
    model, batch = tiny("gpt2")
    batch = prepare_batch(batch)
    for fn, style in ((step_before, None), (step_after, "after-forward"),
                      (step_keep_buffers, "keep-buffers")):
        mine = memfit.estimate(model, batch, device="gtx-1080-ti", step=fn)
        ours = memfit.estimate(model, batch, device="gtx-1080-ti", zero_grad=style)
        assert (mine.peak_bytes, mine.reserved_bytes, mine.breakdown) == \
            (ours.peak_bytes, ours.reserved_bytes, ours.breakdown)


def test_all_ones_mask_is_kept_for_the_step():
    """The step gets the batch as given (it may read the mask), and the figures are exact: the
    trace reads the mask where the real step does (api._user_step Note 3, trace.known_values)."""
    seen = []

    def reads_the_mask(model, batch, optimizer):
        seen.append("attention_mask" in batch)
        return step_after(model, batch, optimizer)

    for arch in ARCHS:
        model, batch = tiny(arch)
        assert bool(batch["attention_mask"].all())
        est = memfit.estimate(model, batch, optimizer="adamw", step=reads_the_mask)
        t = track_two_steps(model, batch, reads_the_mask, torch.optim.AdamW(model.parameters()))
        assert (est.peak_bytes, est.breakdown) == (t.peak_bytes, t.breakdown)
        assert not any("all ones" in n for n in est.notes)
    assert all(seen)


def test_nothing_the_step_keeps_outlives_the_estimate():
    import gc

    model, batch = tiny("gpt2")
    memfit.estimate(model, batch, optimizer="adamw", step=step_clip_ema, scheduler=step_lr)
    memfit.estimate(model, batch, optimizer="adamw", step=step_fp16_scaler)
    gc.collect()
    assert len(_EMAS) == 0 and len(_SCALERS) == 0     # keyed on the fakes, gone with them
    assert all(p.grad is None for p in model.parameters())


# -- what a user step cannot do, refused with the fix ------------------------------------------

def test_a_captured_real_model_is_refused_with_the_fix():
    model, batch = tiny("gpt2")
    real_opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closes_over_the_real_model(m, b, optimizer):
        real_opt.zero_grad()
        model(**b).loss.backward()      # the real model, not the one passed in
        real_opt.step()

    with pytest.raises(ValueError, match="real tensor it did not receive.*WeakKeyDictionary"):
        memfit.estimate(model, batch, step=closes_over_the_real_model)
    assert all(p.grad is None for p in model.parameters())


def test_reading_a_value_back_is_refused_with_the_fix():
    model, batch = tiny("gpt2")

    def logs_the_loss(m, b, optimizer):
        loss = step_before(m, b, optimizer)
        print(f"loss {loss.item():.3f}")

    with pytest.raises(memfit.TraceError, match="reads a value back.*Return the loss"):
        memfit.estimate(model, batch, step=logs_the_loss)


@pytest.mark.parametrize("knobs,needle", [
    ({"precision": "bf16"}, "torch.autocast"), ({"micro_batch_size": 1}, "split it inside"),
    ({"max_grad_norm": 1.0}, "clip_grad_norm_"), ({"zero_grad": "after-forward"}, "zero_grad"),
    ({"remat": True}, "DTR"), ({"loss_fn": lambda m, b: m(**b).loss}, "own loss"),
])
def test_knobs_the_step_fixes_are_refused(knobs, needle):
    model, batch = tiny("gpt2")
    with pytest.raises(ValueError, match=needle):
        memfit.estimate(model, batch, step=step_before, **knobs)
    with pytest.raises(ValueError, match=needle):
        memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, step=step_before,
                   **knobs)


@pytest.mark.parametrize("step,needle", [
    (lambda model, batch: None, "fn\\(model, batch, optimizer\\)"),
    ("train_step", "must be a function"),
    (lambda model, batch, optimizer: (step_before(model, batch, optimizer), 1), "returned tuple"),
])
def test_bad_steps_are_refused(step, needle):
    model, batch = tiny("gpt2")
    with pytest.raises(ValueError, match=needle):
        memfit.estimate(model, batch, step=step)


def test_a_scheduler_instance_is_refused_by_estimate():
    model, batch = tiny("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="factory"):
        memfit.estimate(model, batch, opt, step=step_before, scheduler=step_lr(opt))


def step_cuda_autocast(model, batch, optimizer):
    optimizer.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA autocast runs where CUDA is")
def test_cuda_autocast_without_cuda_is_refused_for_a_gpu():
    """Here ``torch.autocast("cuda")`` is turned off (a warning), so a GPU estimate would count
    an fp32 step: refused with the fix (memfit.step Note 3). For the CPU it is what runs."""
    model, batch = tiny("gpt2")
    batch = prepare_batch(batch)
    with pytest.warns(UserWarning, match="Disabling autocast"):
        cpu = memfit.estimate(model, batch, optimizer="sgd", step=step_cuda_autocast)
    assert cpu.peak_bytes == memfit.estimate(model, batch, optimizer="sgd",
                                             step=step_before).peak_bytes
    with pytest.raises(ValueError, match=r"torch.autocast\('cuda'\).*precision='bf16'"):
        memfit.estimate(model, batch, optimizer="sgd", step=step_cuda_autocast,
                        device="a100-80gb")
