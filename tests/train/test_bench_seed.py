"""``memfit bench seed``: each row's numbers equal ``memfit estimate``'s for the same flags (the
oracle is the estimate command itself, run through ``memfit.cli.main``), a rerun reads the
cache and prints the same numbers, and bad flags are refused in one line."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from memfit.cli import main as memfit_main
from tests.train.conftest import cli


def estimate_cli(argv) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert memfit_main(["estimate", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def bench_json(argv, monkeypatch, tmp_path) -> dict:
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    code, out, err = cli(["bench", "seed", *argv, "--json"])
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_tiny_rows_from_one_shared_trace_equal_memfit_estimate_and_the_cache_repeats_them(
        monkeypatch, tmp_path):
    from memfit import zoo

    argv = ["--tiny", "--models", "base", "--seq-lens", "32,48", "--batch-sizes", "4",
            "--precisions", "fp16", "--checkpointing", "on", "--no-plan", "--gpu", "rtx-6000"]
    first = bench_json(argv, monkeypatch, tmp_path)
    assert len(first["rows"]) == 2
    # the same model as a config file, through `memfit estimate --config`
    config = tmp_path / "config.json"
    zoo.get("xlm-roberta-base").config(tiny=True).to_json_file(str(config))
    for row in first["rows"]:
        assert (row["precision"], row["checkpoint"], row["cached"]) == ("fp16", "all", False)
        assert row["shared_trace"] is True         # one trace for both rows
        est = estimate_cli(["--config", str(config), "--batch-size", str(row["batch_size"]),
                            "--seq-len", str(row["seq_len"]), "--precision", "fp16",
                            "--checkpoint", "all", "--gpu", "rtx-6000",
                            "--task", "sequence-classification"])
        for key in ("peak_bytes", "reserved_bytes", "device_bytes", "fits", "limit_bytes"):
            assert row[key] == est[key], (row, key)
    assert len({r["peak_bytes"] for r in first["rows"]}) == 2
    again = bench_json(argv, monkeypatch, tmp_path)
    assert [r["cached"] for r in again["rows"]] == [True] * 2
    assert [{k: v for k, v in r.items() if k != "cached"} for r in again["rows"]] == \
        [{k: v for k, v in r.items() if k != "cached"} for r in first["rows"]]
    assert first["gpu"] == "rtx-6000" and first["measured"] is False   # another card than here


@pytest.mark.slow       # a shared trace and two plain ones of XLM-R base (~15 s quiet)
def test_base_rows_equal_memfit_estimate(monkeypatch, tmp_path):
    out = bench_json(["--models", "base", "--seq-lens", "128", "--batch-sizes", "8,16",
                      "--precisions", "fp16", "--checkpointing", "off", "--no-plan",
                      "--gpu", "1080ti", "--no-cache"], monkeypatch, tmp_path)
    for row in out["rows"]:
        assert row["shared_trace"] is True
        est = estimate_cli(["--model", "xlm-roberta-base", "--batch-size",
                            str(row["batch_size"]), "--seq-len", "128", "--precision", "fp16",
                            "--gpu", "1080ti"])
        for key in ("peak_bytes", "reserved_bytes", "device_bytes", "fits"):
            assert row[key] == est[key], (row, key)


@pytest.mark.parametrize("argv,needle", [
    (["--gpu", "cpu"], "is for a GPU"),
    (["--gpu", "gtx-9999"], "gtx-9999"),
    (["--batch-sizes", "0"], "at least 1"),
    (["--models", "huge"], "choose from base, large"),
    (["--plot", "/nonexistent/x.png"], "does not exist"),
])
def test_bad_flags(argv, needle):
    code, out, err = cli(["bench", "seed", *argv])
    assert code == 2 and "Traceback" not in err and needle in err, err


def test_help():
    code, out, _ = cli(["bench", "seed", "--help"])
    assert code == 0 and "--gpu" in out and "rtx-6000" in out
    code, out, _ = cli(["bench"])
    assert code == 2 and "seed" in out


@pytest.mark.slow       # two spawned workers import torch + transformers (25 s idle, minutes loaded)
def test_rows_traced_by_worker_processes_equal_the_rows_traced_here(tmp_path, monkeypatch):
    """The pool (train._seed_pool) changes where a row is traced, never its numbers: three rows
    (two of them one shared trace) in two spawned workers, against the same rows traced alone
    in this process, and back in the table's order."""
    import memfit
    from memfit.train._seed_pool import trace_rows
    from memfit.train.seed_table import Row, estimate_row

    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "cache"))
    device = memfit.devices.get_device("rtx-6000")
    rows = [Row("xlm-roberta-base", 32, "fp32", "none", 2, True),
            Row("xlm-roberta-base", 32, "fp16", "all", 4, True),
            Row("xlm-roberta-base", 48, "fp32", "none", 3, True)]    # shares the first's trace
    seen = []
    got, plans = trace_rows(rows, [], device, use_cache=False, jobs=2,
                            on_done=lambda done, total: seen.append((done, total)))
    assert plans == [] and seen[-1] == (3, 3)
    assert [r["shared_trace"] for r in got] == [True, False, True]
    for row, r in zip(rows, got):
        here = estimate_row(row, device, use_cache=False)
        for key in ("peak_bytes", "reserved_bytes", "device_bytes", "fits"):
            assert r[key] == here[key], (row, key)
    assert got[0]["peak_bytes"] != got[1]["peak_bytes"]
    assert not (tmp_path / "cache").exists()        # no cache asked: none written


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_measure_without_a_gpu_is_refused_and_predictions_say_so(monkeypatch, tmp_path):
    code, out, err = cli(["bench", "seed", "--measure"])
    assert code == 2 and "Traceback" not in err and "sees none here" in err, err
    got = bench_json(["--tiny", "--models", "base", "--seq-lens", "32", "--batch-sizes", "4",
                      "--precisions", "fp32", "--checkpointing", "off", "--no-plan"],
                     monkeypatch, tmp_path)
    assert got["measured"] is False and got["measured_note"] == "predicted only (no GPU here)"
    assert not any(k.startswith("measured") for k in got["rows"][0])


@pytest.mark.requires_gpu
def test_rows_measured_on_this_gpu_beside_the_predictions(monkeypatch, tmp_path):
    """On a GPU: the measured columns of tiny rows, within gpu_check's marks of the prediction
    (allocated 3%, reserved 5%)."""
    got = bench_json(["--tiny", "--models", "base", "--seq-lens", "32,48", "--batch-sizes", "4",
                      "--precisions", "fp32,fp16", "--checkpointing", "off", "--no-plan",
                      "--measure"], monkeypatch, tmp_path)
    assert got["measured"] is True
    for r in got["rows"]:
        assert r["measured_oom"] is False
        assert abs(r["peak_bytes"] / r["measured_allocated_bytes"] - 1) <= 0.03, r
        assert abs(r["reserved_bytes"] / r["measured_reserved_bytes"] - 1) <= 0.05, r


@pytest.mark.requires_gpu
def test_measuring_here_while_predicting_another_card_is_refused():
    other = "gtx-1080-ti" if "1080" not in __import__("torch").cuda.get_device_name() else "h200"
    code, out, err = cli(["bench", "seed", "--measure", "--gpu", other])
    assert code == 2 and "compare like with like" in err, err


def test_gpu_checks_seed_section_predicts_and_measures_nothing_without_a_gpu(monkeypatch):
    """benchmarks/_gpu_seed.py (gpu_check's seed-table slice), dry: the predicted rows are
    ``memfit bench seed``'s, and no measured figure is made up."""
    import sys
    from pathlib import Path

    from rich.console import Console

    import memfit
    from memfit.train.seed_table import Row, estimate_row

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    import _gpu_seed

    rows = [Row("xlm-roberta-base", 32, "fp32", "none", 4, True),
            Row("xlm-roberta-base", 48, "fp32", "none", 4, True)]
    monkeypatch.setattr(_gpu_seed, "ROWS", rows)
    device = memfit.get_device("rtx-6000")
    out = _gpu_seed.seed_check(Console(file=sys.stderr), device, dry_run=True)
    for row, r in zip(rows, out):
        assert r["shared_trace"] is True
        alone = estimate_row(row, device, use_cache=False)
        assert (r["peak_bytes"], r["reserved_bytes"]) == (alone["peak_bytes"],
                                                          alone["reserved_bytes"])
        assert not any(k.startswith("measured") or k == "pass" for k in r)


def test_the_measured_step_starts_from_the_steady_state_and_ooms_are_told_apart():
    """seed_measure's two CPU-checkable parts: steps run until AdamW has its state (and no more),
    and library allocation failures count as out of memory while other errors do not."""
    import torch

    import memfit
    from memfit.train.seed_measure import _out_of_memory, _reach_steady_state
    from tests.helpers import tiny

    model, batch = tiny("bert-base")
    runner = memfit.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-5), batch)
    calls = []
    step = runner.step_unguarded
    runner.step_unguarded = lambda b: calls.append(1) or step(b)
    _reach_steady_state(runner, batch)
    assert calls == [1] and runner.optimizer.state
    _reach_steady_state(runner, batch)
    assert calls == [1]                              # already there: no step
    assert _out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling"))
    assert _out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not _out_of_memory(RuntimeError("expected scalar type Half but found Float"))
