"""``memfit estimate|plan --hf-args FILE.json``: a TrainingArguments JSON as people keep their
runs. The CLI's estimate equals a real ``trainer.train()`` step of the same run (the same
arguments, model config and generated data) measured by track; plan writes the changed
arguments beside the file; bad files and flags the file owns are refused."""

import argparse
import json

import pytest

pytest.importorskip("accelerate")

from memfit import zoo  # noqa: E402
from memfit.cli import main  # noqa: E402
from memfit.cli._hf_args import hf_trainer  # noqa: E402
from tests.integrations.hf_helpers import measure_trainer_step  # noqa: E402

RUN = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 3,
       "optim": "adafactor", "max_grad_norm": 1.0, "logging_strategy": "no",
       "save_strategy": "no", "seed": 0}
SHAPE = ["--seq-len", "16", "--padded", "--gpu", "cpu"]


@pytest.fixture
def run_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(RUN))
    return path


def test_estimate_equals_the_real_trainer_step(tiny_gpt2, run_file, capsys):
    assert main(["estimate", "--config", tiny_gpt2, *SHAPE, "--hf-args", str(run_file),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = zoo.from_config_file(tiny_gpt2)
    model = spec.build(seed=0)                       # the same config, real weights, on CPU
    cli = argparse.Namespace(seq_len=16, task=None, image_size=None, padded=True)
    measured = measure_trainer_step(hf_trainer(spec, model, cli, dict(RUN), samples=32))
    assert out["peak_bytes"] == measured.peak_bytes and out["hf_args"] == str(run_file)
    assert (out["precision"], out["optimizer"]) == ("fp32", "adafactor")     # the file's run


def test_the_runs_precision_and_optimizer_are_the_files(tiny_gpt2, tmp_path, capsys):
    """--json says the Trainer run's precision and optim, not memfit's defaults (fp32, adamw)."""
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps({**RUN, "bf16": True, "optim": "sgd"}))
    assert main(["estimate", "--config", tiny_gpt2, *SHAPE, "--hf-args", str(path),
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["precision"], out["optimizer"]) == ("bf16", "sgd")


@pytest.mark.slow
def test_plan_exports_the_changed_arguments_beside_the_file(tiny_gpt2, run_file, capsys):
    assert main(["estimate", "--config", tiny_gpt2, *SHAPE, "--hf-args", str(run_file),
                 "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["peak_bytes"]
    assert main(["plan", "--config", tiny_gpt2, *SHAPE, "--hf-args", str(run_file),
                 "--budget", str(int(plain * 0.9)), "--export", "transformers", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_device_bytes"] <= int(plain * 0.9) < out["plain_device_bytes"]
    written = json.loads((run_file.parent / "run.memfit.json").read_text())
    assert written == {**RUN, **out["args"]}
    assert json.loads(run_file.read_text()) == RUN                # the user's file is kept


@pytest.mark.parametrize("content, flags, words", [
    ("[1]", [], "not an object"),
    ('{"per_device_batch": 3}', [], "not TrainingArguments keywords"),
    ("{", [], "not valid JSON"),
    ("{}", ["--checkpoint", "all"], "set gradient_checkpointing in the JSON"),
    ("{}", ["--micro-batch-size", "2"], "per_device_train_batch_size"),
    # typed, even where the value is the flag's default (it would be silently ignored)
    ("{}", ["--batch-size", "8"], "--batch-size with --hf-args"),
    ("{}", ["--optimizer", "adamw"], "set optim in the JSON"),
    ("{}", ["--precision", "fp32"], "set bf16 / fp16 in the JSON"),
])
def test_bad_files_and_owned_flags_are_refused(tmp_path, capsys, content, flags, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert main(["estimate", "--hf-args", str(path), *flags]) == 2
    assert words in capsys.readouterr().err


def test_missing_file_is_refused(capsys):
    assert main(["plan", "--hf-args", "/nonexistent/run.json"]) == 2
    assert "no such file" in capsys.readouterr().err

