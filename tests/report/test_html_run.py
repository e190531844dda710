"""memfit train --report (report.html_run): the run's measured peaks beside the plan's
prediction and budget, and the plan's blocks, in one self-contained page."""

import json
import re

from memfit import Knobs
from memfit.planner import Plan
from memfit.report.html_run import write_run_report


def test_run_report_shows_the_highest_measured_step_and_the_plans_blocks(tmp_path):
    costs = [{"name": "layer.0", "mode": "recompute", "saved_bytes": 3 << 20, "time_s": 0.004},
             {"name": "layer.1", "mode": "keep", "saved_bytes": 0, "time_s": 0.0}]
    plan = Plan(Knobs(precision="fp32", micro_batch_size=4), blocks={"layer.0": "recompute",
                                                                     "layer.1": "keep"},
                predicted_peak_bytes=50 << 20, predicted_device_bytes=52 << 20,
                budget_bytes=64 << 20, block_costs=costs, device="cpu")
    records = [{"kind": "train", "step": 1, "peak_bytes": 40 << 20},
               {"kind": "eval", "step": 1, "loss": 0.7},
               {"kind": "train", "step": 2, "peak_bytes": (48 << 20) + 5},
               {"kind": "train", "step": 3, "peak_bytes": None}]      # not sampled
    page = open(write_run_report(str(tmp_path / "run.html"), records, plan, title="run"),
                encoding="utf-8").read()
    assert not re.search(r"<script[^>]+src=", page)
    shown = dict(re.findall(r'data-bytes="(\d+)" data-key="(\w+)"', page)[i][::-1]
                 for i in range(4))
    assert int(shown["measured_peak_bytes"]) == (48 << 20) + 5     # the highest sampled step
    assert int(shown["budget_bytes"]) == 64 << 20
    assert "FITS: 2 of 3 steps measured" in page
    assert re.findall(r'<tr data-block="([^"]+)"', page) == ["layer.0", "layer.1"]
    data = re.search(r'"name":"measured peak of the step".*?"x":(\[[^\]]*\])', page)
    assert json.loads(data.group(1)) == [1, 2]


def test_train_refuses_a_report_path_it_cannot_write(tmp_path, capsys):
    from memfit.cli import main

    assert main(["train", "--data", "x.csv", "--report", str(tmp_path / "r.png")]) == 2
    assert "must end in .html" in capsys.readouterr().err
