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
