"""`memfit calibrate` without a GPU, and `--device FILE.json` / `--cuda-version` on estimate."""

from __future__ import annotations

import json

import pytest
import torch

from memfit.cli import main

FIXTURE = "tests/data/device_profile_a10g_fixture.json"
SMALL = ["--model", "gpt2", "--batch-size", "2", "--seq-len", "32"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_calibrate_without_a_gpu_refuses_in_one_line(capsys, tmp_path):
    assert main(["calibrate", "--output", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memfit: error: memfit calibrate measures this machine's GPU")
    assert "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()


def test_calibrate_refuses_a_bad_output_before_measuring(capsys, tmp_path):
    assert main(["calibrate", "--output", str(tmp_path / "p.txt")]) == 2
    assert "must end in .json" in capsys.readouterr().err


def _estimate_json(capsys, *flags):
    assert main(["estimate", *SMALL, "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_with_a_profile_uses_its_figures(capsys):
    out = _estimate_json(capsys, "--device", FIXTURE)
    m = json.load(open(FIXTURE))["measured"]
    card = out["card"]
    assert card["cuda_context_bytes"] == m["context_bytes"]
    assert card["library_kernels_bytes"] == m["library_kernels_bytes"]
    assert out["device_bytes"] == sum(card[f"{k}_bytes"] for k in
                                      ("allocator", "cublas_workspace", "cuda_context",
                                       "library_kernels", "cudnn", "nccl"))
    assert out["cuda_version"] == "12.4" and out["device"] == "a10g"


@pytest.mark.slow
def test_cuda_version_flag_changes_the_context(capsys):
    new = _estimate_json(capsys, "--gpu", "a10g", "--cuda-version", "12")
    old = _estimate_json(capsys, "--gpu", "a10g", "--cuda-version", "11.6")
    assert old["context_bytes"] - new["context_bytes"] == (1685 - 620) * 1024**2
    assert new["reserved_bytes"] == old["reserved_bytes"]


@pytest.mark.parametrize("flags, message", [
    (["--cuda-version", "abc"], "is not a version"),
    (["--gpu", "b200", "--cuda-version", "11.8"], "12.8 or later"),
    (["--gpu", "cpu", "--cuda-version", "12"], "is for a GPU"),
    (["--device", "missing.json"], "no such file"),
    (["--gpu", "t4", "--device", FIXTURE], "give one of them"),
    (["--device", FIXTURE, "--module-loading", "eager"], "calibrate again"),
])
def test_bad_device_flags_are_one_line_errors(capsys, flags, message):
    assert main(["estimate", *SMALL, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
