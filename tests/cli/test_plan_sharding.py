"""``memfit plan --gpus N|auto --sharding ... --compare-gpus``: bad input is refused before any
trace, naming the flag; a real run answers with the layout the API gives (oracle: the API's own
plan of the same model and batch, and estimate_sharded of its knobs)."""

import json

import pytest

from memfit import zoo
from memfit.cli import main


@pytest.mark.parametrize("args,says", [
    (["--gpus", "0"], "give a number of GPUs"),
    (["--compare-gpus", "--gpu", "a100-40gb"], "leave out --gpu"),
    (["--gpus", "2", "--export", "deepspeed"], "--export with --gpus"),
    (["--gpus", "2", "--batch-size", "auto"], "--batch-size/--seq-len auto"),
])
def test_bad_input_is_refused(tiny_gpt2, capsys, args, says):
    assert main(["plan", "--config", tiny_gpt2, "--seq-len", "16", *args]) == 2
    assert says in capsys.readouterr().err


def test_help_names_the_flags(capsys):
    try:
        main(["plan", "--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    for flag in ("--gpus", "--sharding", "--reshard-after-forward", "--compare-gpus"):
        assert flag in out


@pytest.mark.slow
def test_gpus_auto_json(tiny_gpt2, capsys):
    import memfit
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True, device="meta")
    state = sum(p.numel() for p in model.parameters()) * 16     # fp32 param, grad, 2 moments
    budget = int(state * 0.9)
    assert main(["plan", "--config", tiny_gpt2, "--seq-len", "16", "--batch-size", "4",
                 "--gpu", "cpu", "--budget", f"{budget}B", "--precision", "fp32",
                 "--offload-optimizer", "off", "--gpus", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["gpus"] >= 2 and out["plan"]["predicted_device_bytes"] <= budget
    knobs = {k: v for k, v in out["plan"]["knobs"].items() if v is not None}
    for k in ("checkpoint", "offload"):
        if isinstance(knobs.get(k), list):
            knobs[k] = tuple(knobs[k])
    knobs.pop("offload_optimizer", None)
    batch = spec.make_batch(model, out["plan"]["batch_size"], seq_len=16)
    est = memfit.estimate(model, batch, "adamw", device="cpu", **knobs)
    assert est.peak_bytes == out["plan"]["predicted_peak_bytes"]
