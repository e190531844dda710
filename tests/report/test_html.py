"""The HTML report (report.html): its curve is the verdict's quantity, long steps keep their
exact peak, every op says what it was, the file needs no network, and the page a browser draws
has the timeline, the limit lines and the block table, with the estimate's own peak."""

import os
import re

import pytest

from memfit.measure import CATEGORIES
from memfit.report._browser import chromium, dump_dom, screenshot
from memfit.report._ops import STEP
from memfit.report._view import downsample
from memfit.report.html import PEAK_LABEL, step_view, write_report


def test_gpu_curve_is_the_verdicts_allocated_bytes(gpu_step):
    est, tracker = gpu_step
    view = step_view(est, tracker)
    # the oracle is the estimate's own figure, from trace.cuda's allocator replay; the
    # live-bytes timeline is far below it here (workspaces, rounding), so the old curve was not
    assert view.exact and view.peak_bytes == est.peak_bytes
    assert max(est.timeline) < est.peak_bytes
    for i in range(len(view.allocated)):          # the categories add up to the curve
        assert sum(view.by_category[c][i] for c in CATEGORIES) == view.allocated[i]
    assert step_view(est, None).exact is False    # without the record it says so


def test_cpu_curve_is_the_live_bytes_timeline(cpu_step):
    est, tracker = cpu_step
    view = step_view(est, tracker)
    assert view.allocated == est.timeline          # what track measures, op for op
    assert view.by_category == est.timeline_by_category
    assert view.peak_bytes == est.peak_bytes == est.device_bytes


def test_downsampling_keeps_a_one_op_peak_exactly():
    values = [10] * 100_000
    values[77_777] = 10_000                      # one op
    picks = downsample(values, 1000)
    assert len(picks) <= 1001 and 77_777 in picks and picks[-1] == len(values) - 1
    assert picks == sorted(picks)


def test_each_op_knows_its_module_phase_and_micro_batch(cpu_step):
    est, _ = cpu_step
    info = step_view(est, None).info
    root = est.modules[""]
    (f1, e1), (f2, e2) = root.fw_spans           # the two micro-batches' forwards (the trace's)
    assert {info.micro_batch[i] for i in range(f1, e1 + 1)} == {1}
    assert {info.micro_batch[i] for i in range(f2, e2 + 1)} == {2}
    assert {info.phase[i] for i in range(f2, e2 + 1)} == {"forward"}
    opt = est.phases["optimizer"]
    assert set(info.phase[opt:]) == {"optimizer"} and "optimizer" not in info.phase[:opt]
    assert {info.phase[i] for i in range(*root.bw_spans[0])} == {"backward"}
    for name in est.blocks:                      # a block's ops are its own or its children's
        s, e = est.modules[name].fw_span
        assert all(info.module[i] == name or info.module[i].startswith(name + ".")
                   for i in range(s, e + 1))
    assert info.module[opt] == STEP               # the optimizer step runs in no module


def test_report_is_one_file_that_fetches_nothing(gpu_step, tmp_path):
    est, tracker = gpu_step
    path = write_report(str(tmp_path / "r.html"), [(est, tracker, "the step")],
                        title="tiny", budget_bytes=est.limit_bytes)
    page = open(path, encoding="utf-8").read()
    assert not re.search(r"<script[^>]+src=", page) and "<link" not in page
    assert "Plotly" in page and 'id="blocks"' in page
    assert f'data-bytes="{est.peak_bytes}" data-key="peak_bytes"' in page


def _texts(dom: str, cls: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", t) for t in
            re.findall(rf'class="{cls}"[^>]*>(.*?)</text>', dom, flags=re.S)]


@pytest.mark.slow          # ~10 s of Chromium; .ci/run runs it (with --runslow) after installing it
@pytest.mark.skipif(chromium() is None, reason="headless Chromium is not installed "
                    "(Debian: apt-get install chromium); the rendered page is not checked")
def test_the_rendered_page_shows_the_estimates_peak(gpu_step, cpu_step, tmp_path):
    est, tracker = gpu_step
    plain, plain_tracker = cpu_step               # two steps, as a plan's report has them
    path = write_report(str(tmp_path / "r.html"),
                        [(plain, plain_tracker, "plain step"), (est, tracker, "planned step")],
                        title="tiny", budget_bytes=est.limit_bytes)
    dom = dump_dom(path)                          # the DOM after plotly drew it
    assert dom.count('class="main-svg"') >= 2     # the drawn plot (SVG), not the source
    legend = _texts(dom, "legendtext")
    assert {"params", "activations", "optimizer"} <= set(legend)
    assert any(t.startswith("budget (") for t in legend)
    assert any(t.startswith("NVIDIA GeForce GTX 1080 Ti usable") for t in legend)
    assert len(re.findall(r'class="js-fill"', dom)) >= 2 * len(CATEGORIES)   # stacked areas
    peaks = [int(m.group(1)) for t in _texts(dom, "annotation-text")
             if (m := re.match(rf"{PEAK_LABEL} .* = (\d+) B", t))]
    assert peaks == [plain.peak_bytes, est.peak_bytes]
    rows = re.findall(r'<tr data-block="([^"]+)"', dom)
    assert rows == est.blocks
    shown = re.findall(r'data-bytes="(\d+)" data-key="peak_bytes"', dom)
    assert [int(v) for v in shown] == [plain.peak_bytes, est.peak_bytes]
    keep = os.environ.get("MEMFIT_REPORT_SCREENSHOT")    # .ci/run keeps one as an artifact
    if keep:
        assert os.path.getsize(screenshot(path, keep, 1400, 1500)) > 10_000


@pytest.mark.slow          # a whole plan plus two re-traces, ~1 min on a loaded 2-core machine
def test_plan_report_puts_the_plain_step_beside_the_planned_one(tiny_gpt2_config, tmp_path,
                                                                capsys):
    import json

    from memfit.cli import main

    path = tmp_path / "plan.html"
    assert main(["plan", "--config", tiny_gpt2_config, "--batch-size", "8", "--seq-len", "64",
                 "--gpu", "cpu", "--json", "--report", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    page = path.read_text(encoding="utf-8")
    shown = [int(v) for v in re.findall(r'data-bytes="(\d+)" data-key="peak_bytes"', page)]
    assert shown[1] == out["plan"]["predicted_peak_bytes"]        # the planned step's own
    devices = [int(v) for v in re.findall(r'data-bytes="(\d+)" data-key="device_bytes"', page)]
    assert devices[0] == out["plain_device_bytes"]
    assert "live tensors only" not in page        # both steps re-traced to the same figures
