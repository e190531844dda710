"""``--chunked-loss N`` on ``memfit estimate`` and ``memfit plan``: the figure is the API's
(whose equality with a real CPU step is tests/techniques/test_chunked_loss.py's), the human
output and ``--json`` say it was applied, and bad values exit 2 naming the flag, without a
traceback."""

import json

import pytest

import memfit
from memfit import zoo
from memfit.cli import main

TINY = ["--seq-len", "16", "--batch-size", "2", "--gpu", "cpu"]


def test_estimate_flag_is_the_api_knob(tiny_gpt2, capsys):
    assert main(["estimate", "--config", tiny_gpt2, *TINY, "--chunked-loss", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    batch = spec.make_batch(model, 2, seq_len=16)
    api = memfit.estimate(model, batch, optimizer="adamw", device="cpu", chunked_loss=4)
    assert out["chunked_loss"] == 4 and out["peak_bytes"] == api.peak_bytes
    assert main(["estimate", "--config", tiny_gpt2, *TINY, "--chunked-loss", "4"]) == 0
    assert "loss: chunked over 4 pieces" in capsys.readouterr().out


def test_plan_keeps_a_given_chunked_loss(tiny_gpt2, capsys):
    assert main(["plan", "--config", tiny_gpt2, *TINY, "--chunked-loss", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"]["knobs"]["chunked_loss"] == 2


@pytest.mark.parametrize("value, says", [
    ("-1", "-1: give N >= 1 pieces, or 0 for the model's own loss"),
    ("x", "'x' is not a whole number of pieces"),
])
def test_bad_values_exit_2_naming_the_flag(tiny_gpt2, capsys, value, says):
    assert main(["estimate", "--config", tiny_gpt2, *TINY, "--chunked-loss", value]) == 2
    err = capsys.readouterr().err
    assert "argument --chunked-loss" in err and says in err and "Traceback" not in err


def test_a_model_without_a_head_is_refused_in_words(capsys):
    args = ["estimate", "--model", "bert-base", "--seq-len", "16", "--batch-size", "2",
            "--gpu", "cpu", "--chunked-loss", "4"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--chunked-loss needs a causal LM with an output head" in err
    assert "Traceback" not in err
