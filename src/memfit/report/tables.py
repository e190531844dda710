"""rich tables for estimates and measurements."""

from __future__ import annotations

from rich.table import Table

from memfit.measure import CATEGORIES
from memfit.units import format_bytes

__all__ = ["breakdown_table", "verdict"]


def breakdown_table(breakdown: dict[str, int], peak_bytes: int, title: str = "") -> Table:
    table = Table(title=title or None, title_justify="left")
    table.add_column("category")
    table.add_column("bytes at peak", justify="right")
    table.add_column("share", justify="right")
    for name in CATEGORIES:
        v = breakdown.get(name, 0)
        share = f"{100 * v / peak_bytes:.1f}%" if peak_bytes else "-"
        table.add_row(name, format_bytes(v), share)
    table.add_section()
    table.add_row("[bold]peak[/bold]", f"[bold]{format_bytes(peak_bytes)}[/bold]", "100.0%")
    return table


def verdict(need_bytes: int, limit_bytes: int, where: str) -> str:
    """"fits ..., x to spare" or "does not fit ..., x short", with rich markup."""
    if need_bytes <= limit_bytes:
        return (f"[bold green]FITS[/bold green] {where}: needs {format_bytes(need_bytes)} of "
                f"{format_bytes(limit_bytes)}, {format_bytes(limit_bytes - need_bytes)} to spare")
    return (f"[bold red]DOES NOT FIT[/bold red] {where}: needs {format_bytes(need_bytes)}, "
            f"limit {format_bytes(limit_bytes)}: {format_bytes(need_bytes - limit_bytes)} short")
