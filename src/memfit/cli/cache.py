"""``memfit cache``: what memfit's on-disk cache holds (``info``), or empty it (``clear``)."""

from __future__ import annotations

import argparse
import json
import sys

from memfit.cli._cache_args import CACHE_ENV_HELP, open_cache


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "cache", help="show or clear memfit's cache of computed figures",
        description="memfit keeps figures it computed (the parameter counts `memfit models` "
                    "lists) in a cache on disk, under keys that hash what decides them (the "
                    "model's config, memfit's, torch's and transformers' versions), so a "
                    f"second run reads them at once (docs/cache.md); {CACHE_ENV_HELP}.")
    p.add_argument("action", nargs="?", default="info", choices=("info", "clear"),
                   metavar="{info,clear}",
                   help="info: the folder, its entries and bytes against the limit (default); "
                        "clear: remove every entry")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from memfit.units import format_bytes

    cache = open_cache(args)
    removed = cache.clear() if args.action == "clear" else None
    info = cache.info()
    if args.json:
        out = {"folder": str(info.folder), "entries": info.entries,
               "size_bytes": info.size_bytes, "limit_bytes": info.limit_bytes}
        if removed is not None:
            out["removed"] = removed
        json.dump(out, sys.stdout, indent=2)
        print()
        return 0
    if removed is not None:
        print(f"removed {removed} entries from {info.folder}")
    print(f"memfit cache: {info.folder}: {info.entries} entries, "
          f"{format_bytes(info.size_bytes)} of a {format_bytes(info.limit_bytes)} limit")
    return 0
