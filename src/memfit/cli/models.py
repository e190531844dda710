"""``memfit models``: the built-in models (names for --model, their tasks and sizes).

Names, families and tasks are the zoo's table (``memfit._zoo_table``: no torch); a parameter
count needs the model built, on the meta device, so each is counted once and kept in memfit's
cache (``memfit._cache``) under the model's config and the versions of the code that builds
it: the first listing builds every model (seconds), later ones read the counts.
"""

from __future__ import annotations

import json

from memfit.cli._progress import status as progress
from memfit.cli._cache_args import add_no_cache_arg, open_cache
from memfit.cli._listing import add_listing_parser, print_listing


def add_parser(sub):
    p = add_listing_parser(
        sub, "models", help="list the built-in models (names for --model)",
        description="The model zoo: the name to pass as --model, its family, its tasks (for "
                    "--task; the first is the default) and its parameter count (built on the "
                    "meta device: no memory; counted once, then read from memfit's cache).",
        run=run)
    add_no_cache_arg(p)
    return p


def rows(cache=None) -> list[dict]:
    """One row per built-in model; parameter counts from ``cache`` (a ``memfit._cache.Cache``,
    or None: counted now) where it has them."""
    from memfit._zoo_table import ROWS

    counts = _parameter_counts(ROWS, cache)
    return [{"name": row.name, "family": row.family, "default_task": row.default_task,
             "tasks": [row.default_task] + [t for t in row.architectures if t != row.default_task],
             "parameters": counts[row.name], "source": row.source, "aliases": list(row.aliases)}
            for row in ROWS]


def _parameter_counts(rows, cache) -> dict[str, int]:
    """Each model's parameter count (``zoo.count_parameters`` of it built on the meta device),
    read from ``cache`` where it is there, else counted and stored."""
    code = _code_versions() if cache is not None else {}
    keys = {row.name: _count_key(row, code) for row in rows} if cache is not None else {}
    counts = {}
    for name, key in keys.items():
        data = cache.get(key)
        if data is not None:
            counts[name] = json.loads(data)["parameters"]
    missing = [row for row in rows if row.name not in counts]
    if not missing:
        return counts
    from rich.console import Console

    from memfit import zoo
    from memfit.cli._common import _quiet_transformers

    _quiet_transformers()
    with progress(Console(stderr=True), f"building {len(missing)} models on the meta device to "
                                     "count their parameters (kept in memfit's cache)..."):
        for row in missing:
            counts[row.name] = zoo.count_parameters(zoo.get(row.name).build(device="meta"))
            if cache is not None:
                cache.put(keys[row.name], json.dumps({"parameters": counts[row.name]}).encode())
    return counts


def _code_versions() -> dict:
    """The code that builds a model: memfit's, torch's and transformers' versions."""
    from memfit._versions import code_version, library_version, torch_build

    return {"memfit": code_version(), "torch": torch_build().version,
            "transformers": library_version("transformers")}


def _count_key(row, code: dict) -> str:
    """What decides a model's parameter count: its config, its head class and ``code``."""
    from memfit._cache import key_of

    return key_of(figure="zoo-parameter-count", model=row.name, config_class=row.config_class,
                  config=row.config_values, architecture=row.architectures[row.default_task],
                  **code)


def run(args) -> int:
    columns = [("name", {"no_wrap": True}), ("family", {"no_wrap": True}),
               ("parameters", {"justify": "right", "no_wrap": True}),
               ("tasks (for --task; the default first)", {})]
    return print_listing(
        args, rows(open_cache(args)), "Built-in models (pass the name as --model, or --config PATH for your own)",
        columns,
        lambda r: [r["name"], r["family"], f"{r['parameters'] / 1e6:,.0f}M", ", ".join(r["tasks"])])
