"""``--zero-grad`` on ``memfit estimate`` and ``memfit plan`` (issue 12): the loop style reaches
the trace, a bad value exits 2 with the valid ones, and the help says what each style means."""

import json

import memfit
from memfit import zoo
from memfit.cli import build_parser, main

TINY = ["--seq-len", "16", "--batch-size", "2", "--gpu", "cpu"]


def estimate_json(capsys, config, *args):
    assert main(["estimate", "--config", config, *TINY, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_zero_grad_is_the_api_knob(tiny_gpt2, capsys):
    """Each style's CLI figure is the API's for the same model and batch (whose equality with a
    real run is tests/runtime/test_zero_grad.py's); the styles differ as they must."""
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    batch = spec.make_batch(model, 2, seq_len=16)
    peaks = {"before-forward": estimate_json(capsys, tiny_gpt2)["peak_bytes"]}
    for style in ("after-forward", "keep-buffers"):
        out = estimate_json(capsys, tiny_gpt2, "--zero-grad", style)
        api = memfit.estimate(model, batch, optimizer="adamw", device="cpu", zero_grad=style)
        assert out["peak_bytes"] == api.peak_bytes
        peaks[style] = out["peak_bytes"]
    # last step's gradients alive through the forward; buffers alive all the time
    assert peaks["before-forward"] < peaks["after-forward"] <= peaks["keep-buffers"]


def test_plan_traces_and_keeps_the_zero_grad_style(tiny_gpt2, capsys):
    """The plan's knobs keep the style and its prediction is the style's trace (plus the
    all-ones attention mask the runner keeps alive beside the step: api._planner Note 3)."""
    assert main(["plan", "--config", tiny_gpt2, *TINY, "--precision", "fp32", "--zero-grad",
                 "after-forward", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["knobs"]["zero_grad"] == "after-forward"
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    batch = spec.make_batch(model, 2, seq_len=16)
    est = memfit.estimate(model, batch, optimizer="adamw", device="cpu", zero_grad="after-forward")
    mask = batch["attention_mask"]
    held = mask.numel() * mask.element_size()
    assert out["plan"]["predicted_peak_bytes"] == est.peak_bytes + held


def test_bad_zero_grad_exits_2_naming_the_styles(capsys):
    for command in ("estimate", "plan"):
        assert main([command, "--zero-grad", "sideways"]) == 2
        err = capsys.readouterr().err
        assert "sideways" in err and "after-forward" in err and "keep-buffers" in err
        assert "Traceback" not in err


def test_help_explains_the_styles():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command in ("estimate", "plan"):
        text = sub.choices[command].format_help()
        assert "--zero-grad" in text and "set_to_none=False" in text
