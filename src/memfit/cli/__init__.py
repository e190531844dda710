"""``memfit`` command line: one module per subcommand, each a thin shell over the API.

Nothing is imported from torch until a subcommand runs, so ``memfit --help`` answers at once.
Bad input ends in one line, ``memfit: error: ...`` naming CLI flags, and exit status 2
(``cli._errors``); anything else is a bug in memfit and shows its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys

from memfit.cli import bench as _bench
from memfit.cli import cache as _cache
from memfit.cli import calibrate as _calibrate
from memfit.cli import estimate as _estimate
from memfit.cli import gpus as _gpus
from memfit.cli import models as _models
from memfit.cli import plan as _plan
from memfit.cli import train as _train
from memfit.cli._cache_args import traces_cached
from memfit.cli._replay import run_replayable
from memfit.cli._args import given_dests, join_dash_values
from memfit.cli._errors import cli_warnings, error_json, format_error, is_user_error

__all__ = ["main", "build_parser"]

_COMMANDS = {"plan": _plan, "estimate": _estimate, "train": _train, "bench": _bench,
             "gpus": _gpus, "models": _models, "calibrate": _calibrate, "cache": _cache}
# Libraries' import-time chatter that says nothing about the user's job: torchao (imported by
# transformers when installed) logs each CUDA kernel library a CPU-only build cannot load, and
# torch logs torchao's deprecated pytree registrations. Raised to errors for the CLI only.
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


def build_parser() -> argparse.ArgumentParser:
    from memfit import __version__

    parser = argparse.ArgumentParser(
        prog="memfit",
        description="Make a PyTorch training step fit the GPU memory you have. With no "
                    "subcommand, runs `memfit plan` on its built-in default: XLM-RoBERTa-large, "
                    "batch 32, length 256, AdamW, precision auto, on a GTX 1080 Ti.",
    )
    parser.add_argument("--version", action="version", version=f"memfit {__version__}",
                        help="print memfit's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version"):
        argv = ["plan", *argv]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            args = parser.parse_args(join_dash_values(argv))
    except SystemExit as e:         # --help, --version, or argparse refusing a value (2)
        code = e.code if isinstance(e.code, int) else 2
        sys.stderr.write(_short_usage(said.getvalue(), argv[0]) if code else said.getvalue())
        if code and "--json" in argv:       # refused under --json: JSON too, on stdout
            import json

            last = (said.getvalue().strip().splitlines() or ["invalid arguments"])[-1]
            json.dump({"error": last.split(": error: ", 1)[-1], "type": "usage"}, sys.stdout,
                      indent=2)
            print()
        return code
    sys.stderr.write(said.getvalue())
    args.given = given_dests(parser, join_dash_values(argv))    # the flags typed
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    flags = _option_strings(parser, args.command)
    with cli_warnings(flags=flags):
        try:
            with traces_cached(args) as cache:
                return run_replayable(args, argv, cache, lambda: args.run(args) or 0)
        except BrokenPipeError:     # `memfit gpus | head`: the reader left; nothing to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except KeyboardInterrupt:
            print("memfit: interrupted", file=sys.stderr)
            return 130
        except Exception as e:      # bad input or a job that cannot fit: what, and the fix
            if not is_user_error(e):
                raise               # a bug in memfit: its traceback is the report
            if getattr(args, "json", False):     # one JSON object on stdout, whatever happened
                import json

                json.dump(error_json(e, flags), sys.stdout, indent=2)
                print()
            print(format_error(e, flags), file=sys.stderr)
            return 2


def _short_usage(said: str, first: str) -> str:
    """argparse's refusal without the whole usage it prints first (60 lines for ``plan``):
    its error line, and where the flags are listed (the subcommand's help where ``first``, the
    command line's first word, names one: argparse words an unknown flag as the top level's)."""
    lines = said.strip().splitlines()
    error = next((line for line in reversed(lines) if ": error: " in line), None)
    if error is None:
        return said
    command = error.split(": error: ", 1)[0]
    if command == "memfit" and first in _COMMANDS:
        command = f"memfit {first}"
    return f"{error}\n(`{command} --help` lists every flag)\n"


def _option_strings(parser: argparse.ArgumentParser, command: str | None) -> set[str] | None:
    """Every flag of subcommand ``command`` (an error is rewritten to name flags only where the
    command has every one it names)."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        sub = action.choices.get(command) if hasattr(action, "choices") else None
        if sub is not None:
            return {o for a in sub._actions for o in a.option_strings}
    return None
