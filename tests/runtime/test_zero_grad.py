"""The ``zero_grad`` knob: memfit's own loop in three styles (issue 12, ``memfit.step`` Note 1).

Oracles: ``estimate(zero_grad=s)`` equals ``track`` of the real ``memfit.fit(zero_grad=s)``
Runner to the byte; the Runner really calls zero_grad where the style says (gradients seen, or
not, by a forward pre-hook); training is bitwise the same in every style (they differ in
memory, not math); the knob's bad values name the good ones.
"""

import copy

import pytest
import torch

import memfit
from memfit.knobs import ZERO_GRADS
from tests.helpers import tiny, track_runner_step

ARCHS = ["gpt2", "bert-base", "llama-1b"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("style", ["after-forward", "keep-buffers"])   # before: test_estimate_exact
def test_estimate_equals_track_of_the_runner(arch, style):
    model, batch = tiny(arch)
    est = memfit.estimate(model, batch, optimizer="adamw", zero_grad=style)
    t = track_runner_step(model, batch, "adamw", zero_grad=style)
    assert est.peak_bytes == t.peak_bytes
    assert est.breakdown == t.breakdown
    assert est.timeline == t.timeline


@pytest.mark.slow
@pytest.mark.parametrize("style,knobs", [("after-forward", {"micro_batch_size": 1}),
                                         ("keep-buffers", {"micro_batch_size": 1}),
                                         ("after-forward", {"precision": "fp16"}),
                                         ("keep-buffers", {"checkpoint": "all"})])
def test_styles_compose_with_other_knobs(style, knobs):
    model, batch = tiny("gpt2")
    est = memfit.estimate(model, batch, optimizer="adamw", zero_grad=style, **knobs)
    t = track_runner_step(model, batch, "adamw", zero_grad=style, **knobs)
    assert est.peak_bytes == t.peak_bytes and est.breakdown == t.breakdown


def test_styles_cost_what_they_keep_alive():
    """after-forward holds last step's gradients through the forward; keep-buffers never
    frees them; on a step whose peak is in the backward both add the gradients' bytes there."""
    model, batch = tiny("bert-base")
    peaks = {s: memfit.estimate(model, batch, optimizer="sgd", zero_grad=s) for s in ZERO_GRADS}
    before = peaks["before-forward"]
    assert memfit.estimate(model, batch, optimizer="sgd").peak_bytes == before.peak_bytes
    assert before.peak_bytes < peaks["after-forward"].peak_bytes
    assert peaks["after-forward"].peak_bytes <= peaks["keep-buffers"].peak_bytes
    # keep-buffers: the gradients are there at the first op of the step already
    first = {s: e.timeline_by_category["grads"][0] for s, e in peaks.items()}
    assert first["keep-buffers"] == peaks["keep-buffers"].breakdown["grads"] > 0


def _grads_seen_by_forward(model, batch, style, steps=2):
    """Whether any parameter had a gradient when each forward began, in ``fit``'s Runner."""
    seen = []
    model.register_forward_pre_hook(
        lambda m, args: seen.append(any(p.grad is not None for p in m.parameters())))
    runner = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                        zero_grad=style)
    for _ in range(steps):
        runner.step(batch)
    zeroed = all(p.grad is None or not p.grad.any() for p in model.parameters())
    return seen, zeroed


def test_the_runner_calls_zero_grad_where_the_style_says():
    model, batch = tiny("gpt2")
    assert _grads_seen_by_forward(copy.deepcopy(model), batch, "before-forward")[0] == \
        [False, False]
    assert _grads_seen_by_forward(copy.deepcopy(model), batch, "after-forward")[0] == \
        [False, True]                       # step 2's forward runs with step 1's gradients
    # keep-buffers: the buffers exist (zeroed in place) when step 2's forward runs
    seen, _ = _grads_seen_by_forward(copy.deepcopy(model), batch, "keep-buffers")
    assert seen == [False, True]


def test_every_style_trains_the_same():
    model, batch = tiny("llama-1b")
    runs = {}
    for style in ZERO_GRADS:
        m = copy.deepcopy(model)
        runner = memfit.fit(m, torch.optim.AdamW(m.parameters(), lr=1e-2), batch,
                            zero_grad=style, micro_batch_size=2)
        losses = []
        for i in range(3):
            torch.manual_seed(i)
            losses.append(runner.step(batch))
        runs[style] = (losses, m)
    ref_losses, ref = runs["before-forward"]
    for style, (losses, m) in runs.items():
        assert losses == ref_losses, style
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad), style


@pytest.mark.parametrize("bad", ["after_forward", "none", True, 1])
def test_bad_style_names_the_valid_ones(bad):
    with pytest.raises(ValueError, match="before-forward, after-forward, keep-buffers"):
        memfit.Knobs(zero_grad=bad)
    model, batch = tiny("gpt2")
    with pytest.raises(ValueError, match="keep-buffers"):
        memfit.estimate(model, batch, zero_grad=bad)
