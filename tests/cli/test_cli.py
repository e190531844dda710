"""The `memfit estimate` command: JSON, tables, plot, errors, and the README default."""

import argparse
import json

import pytest

from memfit import zoo
from memfit.cli import main


def run_json(capsys, *args):
    assert main(["estimate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_promised_keys(capsys):
    out = run_json(capsys, "--model", "bert-base", "--seq-len", "64", "--batch-size", "2",
                   "--gpu", "t4")
    for key in ("peak_bytes", "reserved_bytes", "breakdown", "fits", "validated", "device"):
        assert key in out
    assert out["device"] == "t4" and out["validated"] is False and out["fits"] is True
    assert sum(out["breakdown"].values()) == out["peak_bytes"]
    assert len(out["blocks"]) == 12


@pytest.mark.slow
def test_default_is_the_story_xlmr_large_on_a_1080_ti(capsys):
    out = run_json(capsys)
    assert out["model"] == "xlm-roberta-large" and out["device"] == "gtx-1080-ti"
    assert out["batch"]["input_ids"] == [8, 256] and out["precision"] == "fp32"
    assert out["fits"] is False


def test_estimate_human_output(capsys):
    assert main(["estimate", "--model", "gpt2", "--seq-len", "32", "--batch-size", "1",
                 "--gpu", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "FITS" in text and "activations" in text


def test_human_output_says_by_how_much_it_misses(capsys):
    assert main(["estimate", "--model", "gpt2", "--seq-len", "128", "--budget", "1GiB"]) == 0
    text = capsys.readouterr().out
    assert "DOES NOT FIT" in text and "short" in text


@pytest.mark.slow
def test_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "t.png"
    out = run_json(capsys, "--model", "vit-base", "--batch-size", "2", "--plot", str(path))
    assert out["plot"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_config_file(tmp_path, capsys):
    from memfit import zoo

    cfg = zoo.get("bert-base").config(tiny=True)
    cfg.architectures = ["BertForMaskedLM"]
    cfg.save_pretrained(tmp_path)
    out = run_json(capsys, "--config", str(tmp_path), "--seq-len", "16", "--gpu", "cpu")
    assert out["task"] == "masked-lm" or out["model"]
    assert out["fits"] is True


@pytest.mark.parametrize("args,needle", [
    (["--model", "bert-bas"], "bert-base"),
    (["--gpu", "rtx-409"], "rtx-4090"),
    (["--budget", "ten gigs"], "11GiB"),
    (["--model", "gtx-1080-ti"], "memfit models"),
    (["--gpu", "gtx-1080-ti", "--precision", "bf16"], "fp16"),
    (["--model", "bert-base", "--seq-len", "4096"], "512"),
])
def test_bad_input_exits_2_with_the_fix(capsys, args, needle):
    assert main(["estimate", *args]) == 2
    assert needle in capsys.readouterr().err


def test_every_flag_has_help():
    from memfit.cli import build_parser

    def check(parser, name):
        for action in parser._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
            if isinstance(action, argparse._SubParsersAction):    # nested: memfit bench seed
                for sub_name, p in action.choices.items():
                    check(p, f"{name} {sub_name}")

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name, p in sub.choices.items():
        check(p, name)


@pytest.mark.slow
def test_technique_flags_lower_the_peak(tmp_path, capsys):
    cfg = zoo.get("gpt2").config(tiny=True, n_layer=6)   # offload brings two blocks back at once
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(tmp_path)
    shape = ["--config", str(tmp_path), "--seq-len", "64", "--batch-size", "8", "--gpu", "cpu"]
    base = run_json(capsys, *shape)
    for flags in (["--checkpoint", "all"], ["--offload", "all"], ["--offload-optimizer"],
                  ["--micro-batch-size", "1"]):
        out = run_json(capsys, *shape, *flags)
        assert out["peak_bytes"] < base["peak_bytes"], flags
        assert (out["host_peak_bytes"] > 0) == (flags[0].startswith("--offload")), flags


@pytest.mark.slow
def test_remat_flag_simulates_dtr_under_the_budget(capsys):
    small = ["--model", "gpt2", "--seq-len", "256", "--batch-size", "8", "--gpu", "cpu"]
    plain = run_json(capsys, *small)["peak_bytes"]
    out = run_json(capsys, *small, "--budget", str(int(plain * 0.97)), "--remat")
    assert out["remat_floor_bytes"] <= out["remat_peak_bytes"] <= int(plain * 0.97) < plain
    assert out["remat_recompute_flops"] > 0
