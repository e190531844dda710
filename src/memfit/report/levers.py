"""rich table of ``memfit.api.levers.what_if`` rows: peak memory as each lever is scaled."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from memfit.units import format_bytes

__all__ = ["what_if_table"]

_UNITS = {"seq_len": "tokens", "hidden_size": "hidden", "num_layers": "layers"}


def what_if_table(rows: Sequence, title: str = "") -> Table:
    """One section per lever; each row: factor, value, peak, device bytes, the change against
    the 1.0 row of its lever, and whether it fits. ``rows``: ``WhatIfRow``s as ``what_if``
    returns them (grouped by lever)."""
    table = Table(title=title or None, title_justify="left")
    table.add_column("lever")
    table.add_column("factor", justify="right")
    table.add_column("value", justify="right")
    table.add_column("peak", justify="right")
    table.add_column("device", justify="right")
    table.add_column("vs 1.0", justify="right")
    table.add_column("fits")
    base = {r.lever: r.device_bytes for r in rows if r.factor == 1.0}
    lever = None
    for r in rows:
        if lever is not None and r.lever != lever:
            table.add_section()
        lever = r.lever
        ref = base.get(r.lever)
        change = f"{100 * (r.device_bytes / ref - 1):+.0f}%" if ref else "-"
        fits = "[green]yes[/green]" if r.fits else "[red]no[/red]"
        table.add_row(r.lever, f"{r.factor:g}", f"{r.value} {_UNITS.get(r.lever, '')}".strip(),
                      format_bytes(r.peak_bytes), format_bytes(r.device_bytes), change, fits)
    return table
