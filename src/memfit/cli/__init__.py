"""``memfit`` command line: one module per subcommand, each a thin shell over the API."""

from __future__ import annotations

import argparse
import sys

from memfit.cli import estimate as _estimate
from memfit.cli import plan as _plan
from memfit.errors import MemfitError

__all__ = ["main"]

_COMMANDS = {"plan": _plan, "estimate": _estimate}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Make a PyTorch training step fit the GPU memory you have. With no "
                    "subcommand, runs `memfit plan` on its built-in default: XLM-RoBERTa-large, "
                    "batch 32, length 256, AdamW, precision auto, on a GTX 1080 Ti.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _COMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["plan", *argv]
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except (ValueError, MemfitError) as e:   # bad input or untraceable: what, and the fix
        print(f"memfit: error: {e}", file=sys.stderr)
        return 2
