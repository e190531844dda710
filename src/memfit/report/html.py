"""The HTML report: one self-contained file (plotly's script and the data inline, nothing
fetched) with the step's memory over time, the limits, the per-block table and the verdict.

Note 1 (what is drawn). Per step (the plain one and the planned one for a plan): the allocated bytes
after each op, stacked by category (``report._view``: the verdict's curve), over the CUDA context
band on a GPU target; the budget and the card's memory as lines; on a GPU target the verdict's
level, reserved + context at the peak (the trace knows it there only: a level, not a curve); phases
and micro-batch starts as vertical lines; the peak op marked, its label giving the exact bytes.
Hovering the curve gives the op, module, phase, micro-batch and bytes by category. Buttons zoom on
each step's peak and back.

Note 2 (one-op peaks). Long steps are downsampled to each run's highest op (``report._view``'s
``envelope``), so the exact peak is a drawn point and nothing above it is dropped.
"""

from __future__ import annotations

import datetime
from html import escape

from memfit.measure import CATEGORIES
from memfit.report._html_tables import blocks_table, verdict_table
from memfit.report._view import StepView, downsample, step_view
from memfit.units import GiB, MiB, format_bytes

__all__ = ["report_html", "write_report", "step_view", "PEAK_LABEL"]

PEAK_LABEL = "peak"
_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c",
           "inputs": "#937860", "activations": "#c44e52", "temporaries": "#da8bc3"}
_CONTEXT_COLOR = "#d9d9d9"


def _unit(views, limits) -> tuple[str, int]:
    top = max([v.est.device_bytes for v in views] + [x for x in limits if x])
    return ("GiB", GiB) if top >= GiB else ("MiB", MiB)


def _step_traces(fig, view: StepView, row: int, unit: tuple[str, int], first: bool) -> float:
    """Draw one step in ``row``; returns the top of what it drew, in the unit."""
    import plotly.graph_objects as go

    name, size = unit
    est, n = view.est, len(view.allocated)
    picks = downsample(view.allocated)
    xs = picks
    ctx = view.context_bytes
    group = f"step{row}"
    if ctx:
        fig.add_trace(go.Scatter(x=xs, y=[ctx / size] * len(xs), stackgroup=group,
                                 line={"width": 0, "shape": "hv"}, fillcolor=_CONTEXT_COLOR,
                                 name=f"CUDA context, kernels ({format_bytes(ctx)})",
                                 legendgroup="context", showlegend=first, hoverinfo="skip"),
                      row=row, col=1)
    for c in CATEGORIES:
        values = view.by_category[c]
        fig.add_trace(go.Scatter(x=xs, y=[values[i] / size for i in picks], stackgroup=group,
                                 line={"width": 0, "shape": "hv"}, fillcolor=_COLORS[c],
                                 name=c, legendgroup=c, showlegend=first, hoverinfo="skip"),
                      row=row, col=1)
    curve = "allocated" + (" + context" if ctx else "") + ("" if view.exact else
                                                           " (live tensors only)")
    fig.add_trace(go.Scatter(
        x=xs, y=[(view.allocated[i] + ctx) / size for i in picks], mode="lines",
        line={"color": "black", "width": 1, "shape": "hv"}, name=curve, legendgroup="curve",
        showlegend=first, text=[view.hover(i) for i in picks],
        hovertemplate="%{text}<extra>" + escape(view.label) + "</extra>"), row=row, col=1)
    p = view.peak_op
    peak_y = (view.peak_bytes + ctx) / size
    label = (f"{PEAK_LABEL} {format_bytes(view.peak_bytes)} allocated = {view.peak_bytes} B "
             f"(op {p} {view.info.op[p]}, {view.info.module[p] or '(root)'})")
    fig.add_trace(go.Scatter(x=[p], y=[peak_y], mode="markers",
                             marker={"symbol": "triangle-down", "size": 10, "color": "black"},
                             name=PEAK_LABEL, legendgroup="peak", showlegend=False,
                             text=[view.hover(p)], hovertemplate="%{text}<extra>peak</extra>"),
                  row=row, col=1)
    fig.add_annotation(x=p, y=peak_y, text=escape(label), showarrow=True, arrowhead=0, ax=30,
                       ay=-28, font={"size": 11}, xanchor="left", row=row, col=1,
                       name=f"peak-{row}")
    top = peak_y
    if ctx:                                  # Note 1: the verdict's level on a GPU target
        level = est.device_bytes / size
        fig.add_trace(go.Scatter(x=[0, n], y=[level, level], mode="lines",
                                 line={"color": "black", "width": 1.5, "dash": "dashdot"},
                                 name=f"reserved + context at the peak "
                                      f"({format_bytes(est.device_bytes)})",
                                 legendgroup=f"level{row}", hoverinfo="name"), row=row, col=1)
        top = max(top, level)
    for phase, start in _phase_lines(view):
        fig.add_vline(x=start, line={"color": "#444", "width": 1, "dash": "dot"}, row=row, col=1,
                      annotation_text=phase, annotation_position="top right",
                      annotation_font_size=10)
    return top


def _phase_lines(view: StepView) -> list[tuple[str, int]]:
    """(label, first op) of each phase change and micro-batch start."""
    info, out, prev = view.info, [], None
    for i, (ph, mb) in enumerate(zip(info.phase, info.micro_batch)):
        key = (ph, mb)
        if key != prev and ph in ("forward", "backward", "optimizer"):
            out.append((f"{ph} mb {mb}" if mb and max(info.micro_batch) > 1 else ph, i))
        prev = key
    return out


def _limit_lines(fig, views, rows, unit, limits: list[tuple[str, int, str]]) -> None:
    import plotly.graph_objects as go

    _, size = unit
    for k, (label, value, dash) in enumerate(limits):
        for j, (view, row) in enumerate(zip(views, rows)):
            n = len(view.allocated)
            fig.add_trace(go.Scatter(x=[0, n], y=[value / size] * 2, mode="lines",
                                     line={"color": "red" if k == 0 else "#7f0000",
                                           "width": 1.5, "dash": dash},
                                     name=f"{label} ({format_bytes(value)})",
                                     legendgroup=f"limit{k}", showlegend=j == 0,
                                     hoverinfo="name"), row=row, col=1)


def figure(views: list[StepView], limits: list[tuple[str, int, str]]):
    """The plotly figure of ``views`` (one row each, one y scale), with ``limits``: (label,
    bytes, dash) lines, the budget first."""
    from plotly.subplots import make_subplots

    unit = _unit(views, [v for _, v, _ in limits])
    fig = make_subplots(rows=len(views), cols=1, shared_yaxes=True, vertical_spacing=0.12,
                        subplot_titles=[v.label for v in views])
    rows = list(range(1, len(views) + 1))
    tops = [_step_traces(fig, v, r, unit, first=r == 1) for v, r in zip(views, rows)]
    _limit_lines(fig, views, rows, unit, limits)
    top = max(tops + [v / unit[1] for _, v, _ in limits]) * 1.12
    buttons = [{"label": "whole step", "method": "relayout",
                "args": [{f"xaxis{'' if r == 1 else r}.range": [0, len(v.allocated)]
                          for v, r in zip(views, rows)}]}]
    for v, r in zip(views, rows):
        p, n = v.peak_op, len(v.allocated)
        half = max(10, n // 40)
        ax = f"xaxis{'' if r == 1 else r}"
        buttons.append({"label": f"zoom on the peak{'' if len(views) == 1 else ': ' + v.label}",
                        "method": "relayout",
                        "args": [{f"{ax}.range": [max(0, p - half), min(n, p + half)]}]})
    fig.update_layout(
        height=420 * len(views) + 80, template="plotly_white",
        hovermode="closest", legend={"x": 1.01, "y": 1, "xanchor": "left"},
        margin={"l": 70, "r": 280, "t": 90, "b": 50},
        updatemenus=[{"type": "buttons", "direction": "right", "x": 0, "y": 1.0 + 0.12 /
                      len(views), "xanchor": "left", "yanchor": "bottom", "buttons": buttons}])
    for r in rows:
        fig.update_yaxes(title_text=f"bytes ({unit[0]})", range=[0, top], row=r, col=1)
        fig.update_xaxes(title_text="op of the training step", row=r, col=1,
                         range=[0, len(views[r - 1].allocated)])
    return fig


_STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:0.8em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}
caption{text-align:left;font-weight:bold;padding:4px 0}
.fits{color:#1a7f37}.nofit{color:#c62828}.verdicts{display:flex;gap:2em;flex-wrap:wrap}
.note{color:#555;font-size:13px}"""


def report_html(views: list[StepView], *, title: str, where: str, budget_bytes: int | None,
                plan=None, notes: list[str] = ()) -> str:
    """The page (module Notes): ``views`` the steps to draw, the last one the verdict's."""
    import plotly.io as pio

    last = views[-1].est
    limits = []
    if budget_bytes is not None:
        limits.append(("budget", budget_bytes, "dash"))
    if last.device.kind == "cuda":
        limits.append((f"{last.device.display_name} usable", last.device.usable_bytes, "dot"))
    fig = figure(views, limits)
    plot = pio.to_html(fig, include_plotlyjs=True, full_html=False, div_id="timeline",
                       config={"displaylogo": False, "responsive": True})
    verdicts = "".join(verdict_table(v, where, budget_bytes) for v in views)
    plain = views[0].est if len(views) > 1 else None
    notes = list(notes) + [f"{v.label}: the curve is the live tensor bytes; the allocator's "
                           "rounding and workspaces are in the verdict, not in the curve"
                           for v in views if not v.exact]
    if plan is not None:
        notes.append(plan.explain())
    note_html = "".join(f'<pre class="note">{escape(n)}</pre>' for n in notes)
    return page(title, f'<div class="verdicts" id="verdict">{verdicts}</div>{plot}'
                       f"<h2>Blocks</h2>{blocks_table(last, plain, plan)}{note_html}",
                f"memfit report, {stamp()}; figures are predicted from a trace on fake "
                f"tensors{'' if last.validated else ' (CUDA model, unvalidated)'}.")


def stamp() -> str:
    """Now, as the reports' footers give it."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def page(title: str, body: str, footer: str) -> str:
    """One self-contained HTML document: the style inline, ``title`` as its heading, ``body``
    (HTML), ``footer`` (HTML) in a note at the end."""
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body><h1>{escape(title)}</h1>{body}"
            f'<p class="note">{footer}</p></body></html>')


def write_report(path: str, steps, *, title: str = "", where: str = "",
                 budget_bytes: int | None = None, plan=None, notes: list[str] = ()) -> str:
    """Write the report of ``steps`` (``StepView``s, or (Estimate, tracker-or-None, label)
    triples) to ``path``; returns ``path``."""
    views = [s if isinstance(s, StepView) else step_view(s[0], s[1], label=s[2])
             for s in steps]
    page = report_html(views, title=title, where=where or views[-1].est.device.display_name,
                       budget_bytes=budget_bytes, plan=plan, notes=notes)
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path
