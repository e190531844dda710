"""What ``memfit gpus`` and ``memfit models`` share: a subcommand that lists rows, as a table
or (``--json``) as a JSON list."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

__all__ = ["add_listing_parser", "print_listing"]


def add_listing_parser(sub, name: str, help: str, description: str,
                       run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(run=run)
    return p


def print_listing(args, rows: list[dict], title: str, columns: list[tuple[str, dict]],
                  cells: Callable[[dict], list[str]]) -> int:
    """``rows`` as JSON (``--json``) or as a table of ``columns`` (header, rich column options)
    with ``cells(row)`` in each line."""
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # no vertical rules: the GPU table's last column keeps its width at 80 columns
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
              collapse_padding=True)
    for header, options in columns:
        t.add_column(header, **options)
    for r in rows:
        t.add_row(*cells(r))
    Console().print(t)
    return 0
