"""``--offload-gradients`` on ``memfit estimate`` and ``memfit plan``: the figure is the API's
(whose equality with a real CPU step is tests/techniques/test_gradient_offload.py's), the output
says it was applied, and what it needs is said with the CLI's flags, without a traceback."""

import json

import memfit
from memfit import zoo
from memfit.cli import main

TINY = ["--seq-len", "16", "--batch-size", "2", "--gpu", "cpu", "--precision", "fp32"]


def test_estimate_flag_is_the_api_knob(tiny_gpt2, capsys):
    args = ["estimate", "--config", tiny_gpt2, *TINY, "--offload-optimizer",
            "--offload-gradients"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    batch = spec.make_batch(model, 2, seq_len=16)
    api = memfit.estimate(memfit.Job(model, batch), device="cpu", offload_optimizer=True,
                          offload_gradients=True)
    assert out["offload_gradients"] is True and out["peak_bytes"] == api.peak_bytes


def test_plan_keeps_a_given_offload_gradients(tiny_gpt2, capsys):
    assert main(["plan", "--config", tiny_gpt2, *TINY, "--offload-optimizer",
                 "--offload-gradients", "--chunked-loss", "0", "--json"]) == 0
    knobs = json.loads(capsys.readouterr().out)["plan"]["knobs"]
    assert knobs["offload_gradients"] is True and knobs["offload_optimizer"] is True


def test_without_the_optimizer_on_the_host_it_is_refused_in_flags(tiny_gpt2, capsys):
    assert main(["estimate", "--config", tiny_gpt2, *TINY, "--offload-gradients"]) == 2
    err = capsys.readouterr().err
    assert "--offload-gradients on needs --offload-optimizer on" in err
    assert "Traceback" not in err
