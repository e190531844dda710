"""benchmarks/public_records.json and .py: every record carries its source, its metric and a
configuration complete enough to rebuild; the script rebuilds the small records and compares
them with the published figures.

The expected values come from the sources themselves (the figure each record quotes), not from
memfit: the checkpointed MLP of EfficientPyTorch (12_pow_model_checkpoint.py) printed
628.63671875 MiB of torch.cuda.max_memory_allocated().
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import public_records as pr  # noqa: E402

MiB = 2**20
SMALL = ["efficientpytorch-mlp-checkpoint-sequential", "efficientpytorch-sgd-accumulation-2"]


@pytest.fixture(scope="module")
def records():
    return pr.load()


@pytest.fixture(scope="module")
def small_run():
    return pr.main(["--only", *SMALL, "--json", "--no-record"])


def test_at_least_twelve_records_each_with_source_metric_and_config(records):
    assert len(records) >= 12
    for r in records:
        assert r["source"]["url"].startswith("https://"), r["id"]
        assert r["source"]["quote"].strip(), r["id"]
        assert r["metric"] in pr.METRICS, r["id"]
        assert r["assumptions"], f"{r['id']}: a record states what it had to assume"
        b = r["batch"]
        assert b["batch_size"] == b["micro_batch_size"] * b["gradient_accumulation_steps"], r["id"]
        assert r["precision"] in ("fp32", "fp16", "bf16", "bf16-pure"), r["id"]


def test_quoted_figure_matches_measured_bytes(records):
    """measured_bytes is the quote's number, in the unit the source printed."""
    for r in records:
        quote = r["source"]["quote"]
        if r["resolution_bytes"] == MiB:             # "... NNNNN MB." from info.used // 1024**2
            assert f"{r['measured_bytes'] // MiB} MB" in quote, r["id"]
        elif r["resolution_bytes"] == 1:             # max_memory_allocated()/1024/1024 printed
            assert repr(r["measured_bytes"] / MiB) in quote, r["id"]


def test_every_metric_kind_reads_one_estimate_field():
    assert set(pr.METRICS.values()) == {"peak_bytes", "reserved_bytes", "device_bytes"}


@pytest.mark.parametrize("field,value,message", [
    ("source", {"quote": "x"}, "source lacks url"),
    ("metric", "nvidia-smi", "metric 'nvidia-smi' is not one of"),
    ("loop", {"style": "trainer", "checkpoint": "none"}, "loop lacks zero_grad"),
    ("measured_bytes", 1.5e9, "'measured_bytes' must be a int"),
])
def test_incomplete_record_is_refused_naming_the_field(records, field, value, message):
    bad = copy.deepcopy(records[0])
    bad[field] = value
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        pr.check_record(bad)


def test_unknown_gpu_and_script_are_refused(records):
    bad = copy.deepcopy(records[0])
    bad["gpu"]["table_name"] = "v100-17gb"
    with pytest.raises(ValueError, match="not in memfit's GPU table"):
        pr.check_record(bad)
    bad = copy.deepcopy(next(r for r in records if "script" in r))
    bad["script"] = "nope"
    with pytest.raises(ValueError, match="script 'nope' is not one of"):
        pr.check_record(bad)


def test_small_records_run_and_compare_with_the_quoted_figures(records, small_run):
    by_id = {r["id"]: r for r in records}
    rows = [row for res in small_run["results"] for row in res["rows"]]
    assert sorted(row["id"] for row in rows) == sorted(SMALL)
    for row in rows:
        assert row["measured_bytes"] == by_id[row["id"]]["measured_bytes"]
        assert row["error"] == (row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
    mlp = next(row for row in rows if row["id"] == SMALL[0])
    assert mlp["measured_bytes"] == round(628.63671875 * MiB)
    # parameters and gradients (2 x 305.35 MiB) dominate; the workspaces (this thread's cuBLAS
    # + cuBLASLt, autograd's thread's cuBLAS: _device_cuda Note 1) are modelled, so what is left is
    # under one workspace (8 MiB + 128 KiB on sm < 90) and a cuBLASLt one
    assert abs(mlp["predicted_bytes"] - mlp["measured_bytes"]) <= 8.125 * MiB + MiB


def test_summary_is_median_and_worst_of_the_rows(small_run):
    rows = [row for res in small_run["results"] for row in res["rows"]]
    s = small_run["summary"]["max_memory_allocated"]
    errs = [abs(row["error"]) for row in rows]
    assert s["records"] == len(rows)
    assert s["median_abs_error"] == statistics.median(errs)
    assert s["worst_abs_error"] == max(errs)
    assert s["worst_id"] == rows[errs.index(max(errs))]["id"]


def test_json_output_is_valid_json(capsys):
    pr.main(["--only", SMALL[0], "--json", "--no-record"])
    out = json.loads(capsys.readouterr().out)
    assert out["results"][0]["id"] == SMALL[0]


def test_only_names_the_valid_ids():
    with pytest.raises(SystemExit, match="no record nope; ids: hf-bert-large-b4"):
        pr.main(["--only", "nope", "--no-record"])
