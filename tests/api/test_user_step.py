"""``estimate(step=fn)`` equals ``track`` of the same real step to the byte (issue 12).

The oracle: the real model, a real optimizer and the user's ``fn``, two real steps under one
``memfit.track`` with the window on the second (``start_window``), exactly the steady state the
trace counts (api._user_step Note 2). Four loop styles on three architectures.
"""

import copy
import weakref

import pytest
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- a deep copy of the model inside the step (issue 26 item 4) --------------------------------
# Oracle: LiveBytes (tests/techniques/test_remat_budget.py), a live-storage count that is not
# memfit's ledger, over the second real call, seeded with all that is alive before it (the copy
# included).

_COPIES = weakref.WeakKeyDictionary()      # model -> the copy the step made of it


def step_swa_ema(model, batch, optimizer):
    """torch's own EMA: AveragedModel deep-copies the model at the first call."""
    ema = _COPIES.get(model)
    if ema is None:
        ema = _COPIES[model] = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    loss = step_before(model, batch, optimizer)
    ema.update_parameters(model)
    return loss


def step_deepcopy_teacher(model, batch, optimizer):
    """A teacher deep-copied after the first backward (the gradients are alive then, and a
    Parameter's deep copy leaves them behind), distilled from in the next steps."""
    optimizer.zero_grad()
    out = model(**batch)
    loss = out.loss
    teacher = _COPIES.get(model)
    if teacher is not None:
        with torch.no_grad():
            target = teacher(**batch).logits
        loss = loss + (out.logits - target).pow(2).mean()
    loss.backward()
    if teacher is None:
        _COPIES[model] = copy.deepcopy(model)
    optimizer.step()
    return out.loss


class ViewBuffers(torch.nn.Module):
    """Two buffers on one storage and a strided parameter: ``Tensor.__deepcopy__`` copies the
    storage once and remakes both views; ``Parameter.__deepcopy__`` clones in its format."""

    def __init__(self):
        super().__init__()
        table = torch.randn(96, 16)
        self.register_buffer("low", table[:32])
        self.register_buffer("high", table[64:])
        self.weight = torch.nn.Parameter(torch.randn(16, 16).t())

    def forward(self, x):
        return (x @ self.weight + self.low.mean(0) + self.high.mean(0)).pow(2).mean()


def step_view_buffers(model, batch, optimizer):
    optimizer.zero_grad()
    loss = model(batch["x"])
    loss.backward()
    optimizer.step()
    copied = _COPIES.setdefault(model, copy.deepcopy(model))
    with torch.no_grad():
        copied.weight.lerp_(model.weight, 0.5)
    return loss


def deep_copy_job(name):
    if name == "view-buffers":
        return ViewBuffers(), {"x": torch.randn(8, 16)}, step_view_buffers
    model, batch = tiny("gpt2")
    fn = step_swa_ema if name == "swa-averaged-model" else step_deepcopy_teacher
    return model, prepare_batch(batch), fn


@pytest.mark.parametrize("name", ["swa-averaged-model", "deepcopy-teacher", "view-buffers"])
def test_a_deep_copy_of_the_model_in_the_step_is_counted_as_the_real_one(name):
    import gc

    from tests.techniques.test_remat_budget import LiveBytes, roots

    model, batch, fn = deep_copy_job(name)
    est = memfit.estimate(model, batch, optimizer="adamw", step=fn)
    gc.collect()
    assert len(_COPIES) == 0                        # the fake copy went with the trace
    opt = torch.optim.AdamW(model.parameters())
    fn(model, batch, opt)
    made = _COPIES[model]
    live = LiveBytes(roots(model, opt, batch) + list(made.parameters()) + list(made.buffers()))
    with live:
        fn(model, batch, opt)
    assert est.peak_bytes == live.peak_bytes


def test_a_read_inside_the_optimizer_is_not_blamed_on_the_step():
    """torch's Adafactor reads its update's RMS (``.item()``), a value of the gradients the
    trace cannot know: the error names torch's line, not the user's step (issue 26 item 7)."""
    model, batch = tiny("gpt2")
    with pytest.raises(memfit.TraceError, match=r"torch/optim/_adafactor\.py:\d+ in ") as e:
        memfit.estimate(model, prepare_batch(batch), optimizer=torch.optim.Adafactor,
                        step=step_before)
    assert "step_before reads a value back" not in str(e.value)
