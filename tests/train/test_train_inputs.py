"""Every bad input to ``memfit train`` ends in one ``memfit: error:`` line naming the problem and
the fix, exit status 2, no traceback, and nothing in the run folder changed. None of these
needs a plan: they are refused before the model is built (setup's order)."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys

import pytest

from memfit.train import checkpoint as ckpt
from tests.train.conftest import cli

TINY = ["--model", "xlm-roberta-base", "--tiny", "--batch-size", "8", "--max-steps", "2",
        "--max-len", "32", "--vocab-size", "400"]


def refused(argv, *needles):
    code, out, err = cli(argv)
    assert code == 2, (out, err)
    assert err.startswith("memfit: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_missing_file_and_no_data(tmp_path):
    refused(["train", "--data", str(tmp_path / "nope.csv"), *TINY], "no such file", "nope.csv")
    refused(["train", *TINY], "--data FILE is needed", "--make-demo-data")


def test_empty_file_header_only_and_unknown_format(tmp_path):
    refused(["train", "--data", write(tmp_path, "e.csv", ""), *TINY], "the file is empty")
    refused(["train", "--data", write(tmp_path, "h.csv", "comment_text,toxic\n"), *TINY],
            "no rows of data")
    refused(["train", "--data", write(tmp_path, "x.parquet", "a"), *TINY], ".csv, .tsv, .jsonl")


def test_missing_columns_name_the_ones_there(toxic_csv):
    refused(["train", "--data", toxic_csv, "--text-column", "text", *TINY],
            "--text-column 'text'", "no such column", "'comment_text', 'lang', 'toxic'")
    refused(["train", "--data", toxic_csv, "--label-column", "label", *TINY],
            "--label-column 'label'", "'toxic'")


def test_a_text_column_that_is_not_text(toxic_csv, tmp_path):
    refused(["train", "--data", toxic_csv, "--text-column", "toxic", *TINY],
            "holds numbers", "not text")
    data = write(tmp_path, "blank.csv", 'comment_text,toxic\nhello,0\n"  ",1\n')
    refused(["train", "--data", data, *TINY], "row 3", "blank")


@pytest.mark.parametrize("labels,needle", [
    (["0", "0.3"], "0.3 (a score: threshold it"),
    (["yes", "no"], "'yes'"),
    (["1", "2"], "no row has 0"),
    (["1", "1"], "at least two classes"),
    (["0", ""], "has no label"),
    (["0", "-1"], "-1"),
])
def test_bad_labels(tmp_path, labels, needle):
    rows = "".join(f"comment {i},{v}\n" for i, v in enumerate(labels))
    data = write(tmp_path, "l.csv", "comment_text,toxic\n" + rows)
    refused(["train", "--data", data, *TINY], "--label-column 'toxic'", needle,
            "0/1 or class ids" if needle not in ("at least two classes",) else "")


def test_jsonl_is_read_and_checked_the_same(tmp_path):
    data = write(tmp_path, "d.jsonl", '{"comment_text": "a", "toxic": 0}\n{"comment_text": 5, '
                                      '"toxic": 1}\n')
    refused(["train", "--data", data, *TINY], "not text")


def test_eval_data_with_a_class_the_training_data_lacks(toxic_csv, tmp_path):
    ev = write(tmp_path, "ev.csv", "comment_text,toxic\na,0\nb,2\nc,1\n")
    refused(["train", "--data", toxic_csv, "--eval-data", ev, *TINY], "--eval-data",
            "made for 2 classes")


def test_bad_flag_values_are_refused_by_the_parser(toxic_csv):
    for argv in (["--batch-size", "0"], ["--lr", "-1"], ["--warmup", "1.5"],
                 ["--budget", "0"], ["--progressive", "abc"]):
        code, _, err = cli(["train", "--data", toxic_csv, *argv])
        assert code == 2 and "Traceback" not in err, err
    refused(["train", "--data", toxic_csv, *TINY, "--progressive", "64"],
            "--progressive 64", "below --max-len 32")


def test_help_and_a_missing_library(monkeypatch, toxic_csv):
    code, out, _ = cli(["train", "--help"])
    assert code == 0 and "--resume" in out and "--budget" in out
    monkeypatch.setitem(sys.modules, "datasets", None)     # as if not installed
    refused(["train", "--data", toxic_csv, *TINY], "pip install 'memfit[train]'")


def _hashes(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def test_corrupt_checkpoint_is_refused_and_the_previous_kept(full_run, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(full_run[0].output, run)
    latest = ckpt.latest(run)
    state = os.path.join(latest, "state.pt")
    with open(state, "r+b") as f:              # a write cut short
        f.truncate(os.path.getsize(state) // 2)
    before = _hashes(run)
    refused(["train", "--resume", run], "is corrupt", "step-0000024",
                  "the previous checkpoint", "step-0000016", "is intact")
    assert _hashes(run) == before              # nothing deleted or rewritten
    with open(state, "r+b") as f:              # same size, one byte changed
        f.truncate(0)
    refused(["train", "--resume", run], "is corrupt")


@pytest.mark.slow      # a plan and 8 steps: the previous checkpoint named above resumes
def test_the_previous_checkpoint_resumes(full_run, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(full_run[0].output, run)
    state = os.path.join(ckpt.latest(run), "state.pt")
    with open(state, "r+b") as f:
        f.truncate(10)
    code, out, err = cli(["train", "--resume", os.path.join(run, "checkpoints", "step-0000016"),
                          "--json"])
    assert code == 0, err                      # the previous one resumes


def test_resume_with_another_model_and_an_occupied_output(full_run, toxic_csv, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(full_run[0].output, run)
    before = _hashes(run)
    refused(["train", "--resume", run, "--model", "xlm-roberta-large"],
            "checkpoint is of another model", "'xlm-roberta-base' -> 'xlm-roberta-large'")
    refused(["train", "--resume", run, "--label-column", "lang"], "--label-column 'lang'")
    refused(["train", "--data", toxic_csv, "--output", run, *TINY], "already holds a run",
            f"--resume {run}")
    refused(["train", "--resume", str(tmp_path / "nothing")], "no such folder")
    assert _hashes(run) == before
