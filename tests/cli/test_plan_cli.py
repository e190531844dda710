"""The `memfit plan` command (the README's main job): JSON, text, exports, plot, errors."""

import json

import pytest

from memfit.cli import main

SHAPE = ["--seq-len", "32", "--batch-size", "4", "--gpu", "cpu"]


@pytest.fixture
def small(tiny_gpt2):
    """A tiny GPT-2 at batch 4 on this CPU: the whole command in seconds."""
    return ["--config", tiny_gpt2, *SHAPE]


def run_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_default_story(out: dict) -> None:
    """What the README's main job must print; .ci/run applies it to `memfit --json` too."""
    assert out["model"] == "xlm-roberta-large" and out["batch"]["input_ids"] == [32, 256]
    plan = out["plan"]
    assert plan["device"] == "gtx-1080-ti" and plan["knobs"]["precision"] == "fp16"
    assert out["plain_device_bytes"] > plan["budget_bytes"]          # plain does not fit ...
    assert plan["predicted_device_bytes"] <= plan["budget_bytes"]    # ... the plan does
    assert plan["predicted_step_time_ratio"] > 0 and out["validated"] is False


@pytest.mark.slow      # minutes: CI checks the same on its own `memfit --json` run (.ci/run)
def test_default_is_the_story_xlmr_large_batch_32_on_a_1080_ti(capsys):
    check_default_story(run_json(capsys))


def test_no_subcommand_runs_plan(small, capsys):
    assert main(small) == 0
    text = capsys.readouterr().out
    assert "memfit plan for cpu" in text and "plain step" in text and "FITS" in text


@pytest.mark.slow
def test_a_budget_below_the_plain_step_changes_the_step(small, capsys):
    plain = run_json(capsys, *small)["plain_device_bytes"]
    out = run_json(capsys, *small, "--budget", str(int(plain * 0.6)), "--export", "deepspeed")
    plan = out["plan"]
    assert plan["predicted_peak_bytes"] <= int(plain * 0.6)
    assert set(plan["blocks"].values()) != {"keep"} or plan["knobs"]["micro_batch_size"] < 4 \
        or plan["knobs"]["offload_optimizer"]
    ds = out["export"]["config"]
    assert ds["train_batch_size"] == 4


@pytest.mark.slow
def test_plot_before_and_after(small, tmp_path, capsys):
    path = tmp_path / "plan.png"
    plain = run_json(capsys, *small)["plain_device_bytes"]
    out = run_json(capsys, *small, "--budget", str(int(plain * 0.8)), "--plot", str(path))
    assert out["plot"] == str(path) and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_below_the_floor_exits_2_with_the_floor_and_levers(small, capsys):
    # the floor of this job is about 890 KiB (the gradients on the host, issue 28): 1 MiB fits
    assert main(["plan", *small, "--budget", "768KiB"]) == 2
    err = capsys.readouterr().err
    assert "MiB" in err and "8-bit (bitsandbytes) optimizer state" in err \
        and "shorter sequences" in err
    assert "integer budget" not in err            # a unit was given


def test_bad_lever_value_is_refused(capsys):
    assert main(["plan", "--seq-len", "long"]) == 2
    assert "'auto'" in capsys.readouterr().err
