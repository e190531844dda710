"""``memfit models``: the built-in models (names for --model, their tasks and sizes)."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("models", help="list the built-in models (names for --model)",
                       description="The model zoo: the name to pass as --model, its family, its "
                                   "tasks (for --task; the first is the default) and its "
                                   "parameter count (built on the meta device: no memory).")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(run=run)
    return p


def rows() -> list[dict]:
    from memfit import zoo
    from memfit.cli._common import _quiet_transformers

    _quiet_transformers()
    out = []
    for name in zoo.names():
        spec = zoo.get(name)
        model = spec.build(device="meta")
        tasks = [spec.default_task] + [t for t in spec.tasks if t != spec.default_task]
        out.append({"name": spec.name, "family": spec.family, "default_task": spec.default_task,
                    "tasks": tasks, "parameters": zoo.count_parameters(model),
                    "source": spec.source, "aliases": list(spec.aliases)})
    return out


def run(args) -> int:
    table = rows()
    if args.json:
        json.dump(table, sys.stdout, indent=2)
        print()
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Built-in models (pass the name as --model, or --config PATH for your own)",
              title_justify="left")
    t.add_column("name", no_wrap=True)
    t.add_column("family", no_wrap=True)
    t.add_column("parameters", justify="right", no_wrap=True)
    t.add_column("tasks (for --task; the default first)")
    for r in table:
        t.add_row(r["name"], r["family"], f"{r['parameters'] / 1e6:,.0f}M", ", ".join(r["tasks"]))
    Console().print(t)
    return 0
