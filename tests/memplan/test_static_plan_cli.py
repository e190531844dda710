"""``memfit estimate --static-plan`` / ``--static-plan-plot``: the API's figures, bad input."""

import json

import pytest

from memfit.cli import main
from memfit.memplan import static_plan
from tests.memplan.conftest import tiny_estimate

TINY = ["--seq-len", "16", "--batch-size", "2"]


@pytest.mark.parametrize("gpu", ["cpu", pytest.param("a100-80gb", marks=pytest.mark.slow)])
def test_json_carries_the_apis_plan(tiny_gpt2_config, capsys, tmp_path, gpu, request):
    plot = tmp_path / "arena.png"
    assert main(["estimate", "--config", tiny_gpt2_config, *TINY, "--gpu", gpu,
                 "--static-plan-plot", str(plot), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["static_plan"]
    api = static_plan(request.getfixturevalue("gpt2_cpu") if gpu == "cpu" else
                      tiny_estimate("gpt2", gpu))
    assert out["arena_bytes"] == api.arena_bytes
    assert out["lower_bound_bytes"] == api.lower_bound_bytes
    assert out["reserved_bytes"] == api.reserved_bytes
    assert out["lower_bound_bytes"] <= out["arena_bytes"] <= out["reserved_bytes"]
    best = out["allocator_options"]["best"]
    assert best in [o["name"] for o in out["allocator_options"]["options"] if o["applicable"]]
    assert out["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_human_output_prints_the_three_figures(tiny_gpt2_config, capsys):
    assert main(["estimate", "--config", tiny_gpt2_config, *TINY, "--gpu", "cpu",
                 "--static-plan"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "static plan of" in text and "lower bound (peak live)" in text
    assert "caching allocator reserved" in text and "(modelled: this step on a GPU)" in text
    assert "least reserved with PyTorch's settings" in text


@pytest.mark.parametrize("flags,says", [
    (["--static-plan-plot", "/no/such/folder/a.png"], "does not exist"),
    (["--static-plan-plot", "arena.txt"], "must end in .png"),
])
def test_bad_plot_path_exits_2_before_tracing(tiny_gpt2_config, capsys, flags, says):
    assert main(["estimate", "--config", tiny_gpt2_config, *TINY, *flags]) == 2
    err = capsys.readouterr().err
    assert "--static-plan-plot" in err and says in err and "Traceback" not in err


def test_sharded_estimate_is_refused_naming_the_flags(tiny_gpt2_config, capsys):
    code = main(["estimate", "--config", tiny_gpt2_config, *TINY, "--gpu", "cpu", "--gpus", "2",
                 "--sharding", "ddp", "--static-plan"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--static-plan" in err and "--gpus/--sharding" in err and "Traceback" not in err
