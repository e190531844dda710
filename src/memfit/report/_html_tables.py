"""The HTML report's tables: the verdict's numbers and the per-block table (``report.html``).

Every byte figure is written twice: in words (``format_bytes``) and exactly, in a
``data-bytes`` attribute, so that a reader (or a test reading the rendered page) gets the
number the verdict used, not a rounded one.
"""

from __future__ import annotations

from html import escape

from memfit.modes import Mode
from memfit.units import format_bytes

__all__ = ["verdict_table", "blocks_table"]


def _b(n: int | None, key: str = "") -> str:
    if n is None:
        return "<td>-</td>"
    attr = f' data-key="{escape(key)}"' if key else ""
    return f'<td class="num" data-bytes="{int(n)}"{attr}>{escape(format_bytes(int(n)))}</td>'


def verdict_table(view, where: str, limit_bytes: int | None = None) -> str:
    """The numbers the verdict is made of, for one step (a ``StepView``), against
    ``limit_bytes`` (default: the estimate's own limit)."""
    est, held = view.est, view.held_bytes
    limit = est.limit_bytes if limit_bytes is None else limit_bytes
    device = est.device_bytes + held
    fits = device <= limit
    rows = [("allocated peak (the curve's maximum)", est.peak_bytes + held, "peak_bytes")]
    if held:
        rows.append(("of which the caller's batch held beside the step", held, "held_bytes"))
    if est.basis == "cuda-model":
        rows += [("reserved by the caching allocator at the peak", est.reserved_bytes + held,
                  "reserved_bytes"),
                 ("outside the allocator: CUDA context, kernels", est.context_bytes,
                  "context_bytes")]
    rows += [("on the device (what the limit caps)", device, "device_bytes"),
             ("limit", limit, "limit_bytes"),
             ("headroom" if fits else "short by", abs(limit - device),
              "headroom_bytes")]
    k = est.knobs
    if k.offload_optimizer or k.offload not in (None, "none") or \
            k.offload_params not in (None, "none"):
        rows.append(("host memory (offload) at its peak", est.host_peak_bytes, "host_peak_bytes"))
    body = "".join(f"<tr><th>{escape(label)}</th>{_b(v, key)}</tr>" for label, v, key in rows)
    word = "FITS" if fits else "DOES NOT FIT"
    cls = "fits" if fits else "nofit"
    return (f'<table class="verdict" data-step="{escape(view.label)}">'
            f'<caption><span class="{cls}">{word}</span> {escape(where)} '
            f'({escape(view.label)}, {escape(est.knobs.precision or "")})</caption>'
            f"{body}</table>")


def blocks_table(chosen, plain=None, plan=None) -> str:
    """One row per block: its mode, what it keeps for backward, and what the mode saves and
    costs: the plan's predicted figures (``Plan.block_costs``) where there is a plan, and the
    traces' own (saved bytes and backward FLOPs, planned vs plain) where both were traced."""
    costs = {c["name"]: c for c in (plan.block_costs if plan is not None else ())}
    head = ["block", "mode", "saved for backward", "inputs (what a checkpoint keeps)",
            "parameters", "forward FLOPs"]
    if plain is not None:
        head += ["saved for backward, plain step", "extra backward FLOPs (traced)"]
    if costs:
        head += ["plan: saves (each)", "plan: time (each)"]
    rows = []
    for name in chosen.blocks:
        r = chosen.modules[name]
        mode = chosen.knobs_blocks.get(name, Mode.KEEP)
        cells = [f"<td>{escape(name)}</td>", f"<td class=\"mode\">{escape(mode)}</td>",
                 _b(r.saved_bytes), _b(r.input_bytes), _b(r.param_bytes),
                 f'<td class="num">{r.fw_flops / 1e9:.2f} G</td>']
        if plain is not None:
            p = plain.modules.get(name)
            cells.append(_b(p.saved_bytes if p is not None else None))
            extra = r.bw_flops - p.bw_flops if p is not None else None
            cells.append(f'<td class="num">{extra / 1e9:+.2f} G</td>' if extra is not None
                         else "<td>-</td>")
        if costs:
            c = costs.get(name)
            keep = c is None or c["mode"] == Mode.KEEP
            cells.append("<td>-</td>" if keep else _b(c["saved_bytes"]))
            cells.append("<td>-</td>" if keep else
                         f'<td class="num">+{1e3 * c["time_s"]:.2f} ms</td>')
        rows.append(f'<tr data-block="{escape(name)}">{"".join(cells)}</tr>')
    if not rows:
        return "<p>No repeated blocks were found in this model.</p>"
    header = "".join(f"<th>{escape(h)}</th>" for h in head)
    return (f'<table id="blocks" class="blocks"><thead><tr>{header}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")
