"""--snapshot (report.snapshot): a predicted step in torch.cuda.memory._snapshot()'s format,
opened by torch.cuda._memory_viz's own functions on the CPU, with the estimate's peak."""

import json
import pickle
import subprocess
import sys

import pytest
from torch.cuda import _memory_viz as viz

from memfit.report.snapshot import snapshot, write_snapshot


def _lines(text: str) -> list[tuple[str, int]]:
    return [(l.rsplit(" ", 1)[0], int(l.rsplit(" ", 1)[1])) for l in text.splitlines() if l]


def _active_bytes(snap) -> int:
    """Bytes in active blocks, as _memory_viz.memory's flame graph counts them (requested
    sizes plus the rounding it calls <gaps>): memory_allocated at the snapshot."""
    return sum(n for key, n in _lines(viz.memory(snap, format_flamegraph=lambda s: s))
               if ";active_allocated;" in key)


def _trace_peak(snap) -> int:
    """An independent count over the trace, as MemoryViz.js's timeline walks it: blocks alive
    in the segments and not allocated in the trace were there before it; then each alloc adds
    its size and each free_completed removes it; the maximum."""
    events = snap["device_traces"][0]
    allocated_in_trace = {e["addr"] for e in events if e["action"] == "alloc"}
    freed_first = {}
    for e in events:
        if e["action"] == "free_completed" and e["addr"] not in allocated_in_trace:
            freed_first.setdefault(e["addr"], e["size"])
    live = sum(b["requested_size"] for s in snap["segments"] for b in s["blocks"]
               if b["state"] == "active_allocated" and b["address"] not in allocated_in_trace)
    live += sum(freed_first.values())
    peak = live
    for e in events:
        if e["action"] == "alloc":
            live += e["size"]
        elif e["action"] == "free_completed":
            live -= e["size"]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("step", ["gpu_step", "cpu_step"])
def test_memory_viz_opens_it_and_counts_the_peak(step, request, tmp_path):
    est, tracker = request.getfixturevalue(step)
    path = write_snapshot(str(tmp_path / "s.pickle"), est, tracker, at="peak")
    with open(path, "rb") as f:
        at_peak = pickle.load(f)
    assert _active_bytes(at_peak) == est.peak_bytes       # what is live at the peak
    end = snapshot(est, tracker)                         # the whole step, taken after it
    for snap in (at_peak, end):
        assert "Summary of segments" in viz.segsum(snap)  # asserts every byte is accounted
        assert "entries" in viz.trace(snap)
        for html in (viz.trace_plot(snap), viz.trace_plot(snap, plot_segments=True),
                     viz.segment_plot(snap)):
            assert "snapshot.pickle" in html              # the data embedded for the viewer
        assert viz.segments(snap, format_flamegraph=lambda s: s)
    assert "only_after" not in viz.compare(at_peak["segments"], at_peak["segments"],
                                           format_flamegraph=lambda s: s)
    if est.basis == "cpu-trace":                          # sizes exact: the trace's own peak
        assert _trace_peak(end) == est.peak_bytes
    else:                                                 # requested sizes, below the rounded
        assert _trace_peak(end) <= est.peak_bytes
        reserved = sum(s["total_size"] for s in at_peak["segments"])
        assert reserved <= est.reserved_bytes
        grown = sum(e["size"] for e in end["device_traces"][0] if e["action"] ==
                    "segment_alloc") + sum(s["total_size"] for s in at_peak["segments"]) - \
            sum(e["size"] for e in at_peak["device_traces"][0] if e["action"] == "segment_alloc")
        assert grown <= est.reserved_bytes


def test_frames_name_the_op_and_the_module(gpu_step):
    est, tracker = gpu_step
    events = snapshot(est, tracker)["device_traces"][0]
    allocs = [e for e in events if e["action"] == "alloc"]
    assert allocs and all(e["frames"][0]["filename"] == "aten" for e in allocs)
    in_blocks = [e for e in allocs if any(f["filename"].startswith(est.blocks[0] + ".")
                                          or f["filename"] == est.blocks[0]
                                          for f in e["frames"])]
    assert in_blocks
    op = in_blocks[0]["frames"][0]
    assert op["name"] == est.op_log[op["line"]].removeprefix("aten.")
    names = {f["name"] for e in allocs for f in e["frames"]}
    assert {"forward micro-batch 1", "backward micro-batch 2", "activations"} <= names


@pytest.mark.slow         # a subprocess: imports and a trace, ~40 s on a loaded 2-core machine
def test_cli_writes_a_snapshot_that_memory_viz_reads(tiny_gpt2_config, tmp_path):
    snap = tmp_path / "step.pickle"
    cmd = [sys.executable, "-m", "memfit", "estimate", "--config", tiny_gpt2_config,
           "--batch-size", "2", "--seq-len", "16", "--gpu", "cpu", "--json",
           "--snapshot", str(snap), "--snapshot-at", "peak"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    figures = json.loads(out.stdout)
    with open(snap, "rb") as f:
        assert _active_bytes(pickle.load(f)) == figures["peak_bytes"]
    assert figures["snapshot"] == str(snap)


@pytest.mark.parametrize("flags, says", [
    (["--snapshot", "{tmp}/x.png"], "must end in .pickle or .pkl"),
    (["--report", "{tmp}/no/such/r.html"], "does not exist"),
    (["--snapshot-at", "peak"], "--snapshot-at needs --snapshot"),
    (["--snapshot", "{tmp}/s.pickle", "--expandable-segments"], "not written yet"),
])
def test_cli_refuses_bad_output_flags_before_tracing(flags, says, tmp_path, capsys):
    from memfit.cli import main

    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main(["estimate", "--model", "gpt2", *flags]) == 2
    assert says in capsys.readouterr().err
