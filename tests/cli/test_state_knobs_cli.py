"""``--optimizer-state`` and ``--offload-params`` on ``memfit estimate``: each figure is the API's
(whose equality with a real run is tests/api/test_optimizer_state_knob.py's and
test_offload_params_knob.py's), and bad combinations exit 2 naming the flags."""

import json

import pytest

import memfit
from memfit import zoo
from memfit.cli import main

TINY = ["--seq-len", "16", "--batch-size", "2", "--gpu", "cpu"]


def _api(**knobs):
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    batch = spec.make_batch(model, 2, seq_len=16)
    return memfit.estimate(model, batch, optimizer="adamw", device="cpu", **knobs)


@pytest.mark.slow
@pytest.mark.parametrize("flags,knobs", [
    (["--optimizer-state", "8bit"], dict(optimizer_state="8bit")),
    (["--offload-params", "all", "--offload-optimizer"],
     dict(offload_params="all", offload_optimizer=True)),
])
def test_flags_are_the_api_knobs(tiny_gpt2, capsys, flags, knobs):
    assert main(["estimate", "--config", tiny_gpt2, *TINY, *flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    api = _api(**knobs)
    assert out["peak_bytes"] == api.peak_bytes
    assert out["peak_bytes"] < _api().peak_bytes          # each saves device bytes


@pytest.mark.parametrize("flags,says", [
    (["--optimizer-state", "8bit", "--optimizer", "sgd"], "low-bit versions of Adam and AdamW"),
    (["--offload-params", "all"], "--offload-params all needs --offload-optimizer"),
    (["--optimizer-state", "int8"], "invalid choice: 'int8'"),
])
def test_bad_combinations_exit_2_naming_the_flags(tiny_gpt2, capsys, flags, says):
    assert main(["estimate", "--config", tiny_gpt2, *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
