"""Plots show what the verdict is about (report.plots Notes 1-3): the device-bytes curve or
level whose maximum is ``est.device_bytes``, a one-op peak, phases, micro-batches, and a legend
outside the axes."""

import pytest

import memfit
from memfit import zoo
from memfit.report._view import envelope
from memfit.report.plots import (DEVICE_CURVE_LABEL, RESERVED_LEVEL_LABEL, before_after_figure,
                                 micro_batch_starts, timeline_figure)


@pytest.fixture(scope="module")
def tiny():
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True)
    return model, spec.make_batch(model, 4, seq_len=32)


def _unit(ax):
    return {"GiB": 2**30, "MiB": 2**20}[ax.get_ylabel().split("(")[1].rstrip(")")]


def _line(ax, label):
    line, = [ln for ln in ax.get_lines() if ln.get_label().startswith(label)]
    return line


def _legend_outside(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    return all(not legend.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)


def test_envelope_keeps_a_one_op_peak():
    timeline = [10] * 50_000
    timeline[31_337] = 99               # one op, far below any pixel column's width
    picks = envelope(timeline, 1200)
    assert len(picks) <= 1200 and max(timeline[i] for i in picks) == 99


def test_cpu_curve_max_is_the_verdict_and_markers_exist(tiny):
    model, batch = tiny
    est = memfit.estimate(model, batch, device="cpu", micro_batch_size=1)
    fig = timeline_figure(est, limit_bytes=est.limit_bytes)
    ax = fig.axes[0]
    curve = _line(ax, DEVICE_CURVE_LABEL)
    assert max(curve.get_ydata()) * _unit(ax) == pytest.approx(est.device_bytes, rel=1e-12)
    assert est.device_bytes == max(est.timeline)            # CPU: the curve is the verdict's
    texts = [t.get_text().strip() for t in ax.texts]
    assert {"forward", "backward", "optimizer"} <= set(texts)
    assert [f"mb {i}" for i in (2, 3, 4)] == [t for t in texts if t.startswith("mb")]
    starts = micro_batch_starts(est)
    assert len(starts) == 4 and starts[0] == est.phases["forward"]
    assert starts[-1] == est.modules[""].fw_span[0] < est.phases["optimizer"]
    assert _legend_outside(fig)


def test_gpu_target_draws_the_reserved_level_it_judges(tiny):
    model, batch = tiny
    est = memfit.estimate(model, batch, device="t4")
    assert est.device_bytes > max(est.timeline) + est.context_bytes   # reserved > live
    fig = timeline_figure(est, limit_bytes=est.limit_bytes)
    fig.savefig("/tmp/mf/gpu.png") if __import__("os").path.isdir("/tmp/mf") else None
    ax = fig.axes[0]
    level = _line(ax, RESERVED_LEVEL_LABEL)
    assert max(level.get_ydata()) * _unit(ax) == pytest.approx(est.device_bytes, rel=1e-12)
    others = [max(ln.get_ydata()) for ln in ax.get_lines() if ln is not level and
              ln.get_transform() == ax.transData]        # data lines (not the phase markers)
    assert max(others) < max(level.get_ydata())     # nothing drawn above the verdict's figure
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(label.startswith("CUDA context") for label in labels)
    assert _legend_outside(fig)


def test_before_after_share_one_scale_and_one_outside_legend(tiny, tmp_path):
    model, batch = tiny
    plain = memfit.estimate(model, batch, device="cpu")
    planned = memfit.estimate(model, batch, device="cpu", checkpoint="all", micro_batch_size=2)
    assert planned.device_bytes < plain.device_bytes   # the higher panel drawn first
    fig = before_after_figure(plain, planned, limit_bytes=plain.device_bytes,
                              titles=("plain", "planned"))
    left, right = fig.axes
    assert left.get_ylim() == right.get_ylim()
    for ax, est in ((left, plain), (right, planned)):
        top = max(_line(ax, DEVICE_CURVE_LABEL).get_ydata())
        assert top * _unit(ax) == pytest.approx(est.device_bytes, rel=1e-12)
        assert top < ax.get_ylim()[1]                       # the peak is inside the axes
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(labels) == len(set(labels)) and _legend_outside(fig)
    path = tmp_path / "p.png"
    fig.savefig(path)
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_gpu_curve_with_the_record_is_the_allocators(tiny):
    from memfit.report._capture import traced

    model, batch = tiny
    with traced(model) as cap:
        est = memfit.estimate(model, batch, device="t4")
    fig = timeline_figure(est, limit_bytes=est.limit_bytes, record=cap.take())
    ax = fig.axes[0]
    curve = _line(ax, "allocated (caching-allocator model)")
    # the oracle: trace.cuda's allocator replay, the verdict's allocated peak (plus the context
    # band the stack stands on); the live bytes alone are below it
    assert max(curve.get_ydata()) * _unit(ax) == pytest.approx(
        est.peak_bytes + est.context_bytes, rel=1e-12)
    assert max(est.timeline) < est.peak_bytes
    texts = [t.get_text() for t in ax.texts]
    assert any(t.startswith(f"peak {memfit.units.format_bytes(est.peak_bytes + est.context_bytes)}")
               for t in texts)


@pytest.mark.slow
def test_plan_plot_on_a_gpu_target_draws_each_steps_allocator_curve(tiny):
    """memfit plan --plot on a GPU target: both panels are the caching-allocator curve of
    their step (re-traced once with the record, cli._report_args.plan_records), each topping
    at that step's verdict: its allocated peak over the context band."""
    import argparse

    from memfit.api.plan import plan_traced
    from memfit.cli._report_args import plan_records

    model, batch = tiny
    device = memfit.devices.get_device("t4")
    planned = plan_traced(model, batch, None, "adamw", device)
    args = argparse.Namespace()
    records = plan_records(args, model, batch, planned, optimizer="adamw", device=device)
    assert all(r is not None for r in records)
    assert plan_records(args, model, batch, planned, optimizer="adamw",
                        device=device) is records            # traced once per command
    fig = before_after_figure(planned.plain, planned.chosen, limit_bytes=device.usable_bytes,
                              records=records)
    for ax, est in zip(fig.axes[:2], (planned.plain, planned.chosen)):
        curve = _line(ax, "allocated (caching-allocator model)")
        assert max(curve.get_ydata()) * _unit(ax) == pytest.approx(
            est.peak_bytes + est.context_bytes, rel=1e-12)
