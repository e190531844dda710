"""The HTML report of a ``memfit train`` run: each step's measured peak beside the plan's
prediction and the budget, the plan's per-block table and the verdict's numbers, in one
self-contained file (plotly's script inline), like ``report.html`` for one step.

Note 1 (what is measured). A run's ``metrics.jsonl`` holds, per step, the peak that
``memfit.track`` (CPU) or the caching allocator (CUDA) measured over the steps it sampled
(``train.measure_steps``; others have none), the plan's predicted allocated peak for the
longest batch, the budget and the batch's length. A step's own op-by-op timeline is in
``memfit estimate --report`` / ``memfit plan --report`` of the same job.
"""

from __future__ import annotations

from html import escape

from memfit.modes import Mode
from memfit.report._html_tables import _b
from memfit.report.html import page, stamp
from memfit.units import GiB, MiB, format_bytes

__all__ = ["run_report_html", "write_run_report"]


def _figure(records: list[dict], budget: int | None, predicted: int | None):
    import plotly.graph_objects as go

    steps = [r for r in records if r.get("kind") == "train"]
    measured = [(r["step"], r["peak_bytes"]) for r in steps if r.get("peak_bytes") is not None]
    top = max([v for _, v in measured] + [budget or 0, predicted or 0] + [1])
    unit, size = ("GiB", GiB) if top >= GiB else ("MiB", MiB)
    fig = go.Figure()
    if measured:
        fig.add_trace(go.Scatter(
            x=[s for s, _ in measured], y=[v / size for _, v in measured], mode="lines+markers",
            name="measured peak of the step", line={"color": "black"},
            text=[f"step {s}: {format_bytes(v)} ({v} B)" for s, v in measured],
            hovertemplate="%{text}<extra></extra>"))
    last = steps[-1]["step"] if steps else 1
    for label, value, color, dash in (("predicted peak (plan, longest batch)", predicted,
                                       "#1f77b4", "dashdot"),
                                      ("budget", budget, "red", "dash")):
        if value:
            fig.add_trace(go.Scatter(x=[0, last], y=[value / size] * 2, mode="lines",
                                     name=f"{label} ({format_bytes(value)})",
                                     line={"color": color, "dash": dash}, hoverinfo="name"))
    near = max([v for _, v in measured] + [predicted or 0] + [1]) / size * 1.3
    buttons = [{"label": "with the budget", "method": "relayout",
                "args": [{"yaxis.range": [0, top / size * 1.15]}]},
               {"label": "zoom on the peaks", "method": "relayout",
                "args": [{"yaxis.range": [0, near]}]}]
    fig.update_layout(updatemenus=[{"type": "buttons", "direction": "right", "x": 0, "y": 1.12,
                                    "xanchor": "left", "buttons": buttons}])
    fig.update_layout(template="plotly_white", height=420, xaxis_title="step",
                      yaxis_title=f"bytes ({unit})", yaxis_range=[0, top / size * 1.15],
                      legend={"x": 1.01, "y": 1, "xanchor": "left"},
                      margin={"l": 70, "r": 280, "t": 60, "b": 50})
    return fig


def run_report_html(records: list[dict], plan, *, title: str) -> str:
    """The page of a run: ``records`` its metrics lines, ``plan`` its ``Plan``."""
    import plotly.io as pio

    steps = [r for r in records if r.get("kind") == "train"]
    measured = [r["peak_bytes"] for r in steps if r.get("peak_bytes") is not None]
    budget = plan.budget_bytes
    fig = _figure(records, budget, plan.predicted_peak_bytes)
    plot = pio.to_html(fig, include_plotlyjs=True, full_html=False, div_id="timeline",
                       config={"displaylogo": False, "responsive": True})
    rows = [("predicted allocated peak (longest batch)", plan.predicted_peak_bytes,
             "predicted_peak_bytes"),
            ("predicted on the device", plan.predicted_device_bytes, "predicted_device_bytes"),
            ("measured peak, highest step", max(measured) if measured else None,
             "measured_peak_bytes"),
            ("budget", budget, "budget_bytes")]
    verdict = "".join(f"<tr><th>{escape(k)}</th>{_b(v, key)}</tr>" for k, v, key in rows)
    fits = bool(measured) and budget is not None and max(measured) <= budget
    word = ("FITS" if fits else "OVER THE BUDGET") if measured and budget else "NOT MEASURED"
    blocks = "".join(
        f'<tr data-block="{escape(c["name"])}"><td>{escape(c["name"])}</td>'
        f'<td class="mode">{escape(c["mode"])}</td>'
        + ("<td>-</td><td>-</td>" if c["mode"] == Mode.KEEP else
           f'{_b(c["saved_bytes"])}<td class="num">+{1e3 * c["time_s"]:.2f} ms</td>')
        + "</tr>" for c in plan.block_costs)
    table = (f'<table id="blocks" class="blocks"><thead><tr><th>block</th><th>mode</th>'
             f"<th>plan: saves (each)</th><th>plan: time (each)</th></tr></thead>"
             f"<tbody>{blocks}</tbody></table>" if blocks else "<p>No per-block modes.</p>")
    return page(title, f'<div class="verdicts" id="verdict"><table class="verdict"><caption>'
                       f"{word}: {len(measured)} of {len(steps)} steps measured</caption>"
                       f"{verdict}</table></div>{plot}<h2>Blocks</h2>{table}"
                       f'<pre class="note">{escape(plan.explain())}</pre>',
                f"memfit train report, {stamp()}. Each step's op-by-op memory: memfit plan "
                "--report on the same model and batch.")


def write_run_report(path: str, records: list[dict], plan, *, title: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(run_report_html(records, plan, title=title))
    return path
