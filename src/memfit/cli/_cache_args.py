"""``--no-cache`` and the cache a subcommand reads: memfit's on-disk cache (``memfit._cache``,
docs/cache.md), at the folder and size the environment gives. The environment is read here,
at the front, and nowhere below it."""

from __future__ import annotations

import contextlib
import os

__all__ = ["add_no_cache_arg", "open_cache", "traces_cached", "CACHE_ENV_HELP"]

CACHE_ENV_HELP = ("the folder is $MEMFIT_CACHE_DIR, else $XDG_CACHE_HOME/memfit, else "
                  "~/.cache/memfit; $MEMFIT_CACHE_LIMIT caps its size (default 1GiB), the least "
                  "recently used entries going first")


def add_no_cache_arg(p) -> None:
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write memfit's cache of computed figures: compute "
                        "them again (`memfit cache` shows where it is; docs/cache.md)")


def open_cache(args):
    """The cache the environment names, or None under ``--no-cache``."""
    if getattr(args, "no_cache", False):
        return None
    from memfit._cache import DEFAULT_LIMIT_BYTES, Cache, default_folder
    from memfit.units import parse_bytes

    text = os.environ.get("MEMFIT_CACHE_LIMIT")
    try:
        limit = DEFAULT_LIMIT_BYTES if not text else parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"MEMFIT_CACHE_LIMIT={text}: {e}") from None
    return Cache(default_folder(os.environ), limit_bytes=limit)


def traces_cached(args):
    """A context in which ``memfit.estimate`` reads and keeps its answers in the cache
    (``memfit.api._trace_cache``), for a subcommand that traces (``--no-cache`` on its
    parser), which its ``with`` gives; a null context (None) for the others. Neither imports
    torch."""
    if not hasattr(args, "no_cache") or args.command not in _TRACING:
        return contextlib.nullcontext()
    from memfit._trace_cache_scope import using

    return using(open_cache(args))        # entered, it gives the cache (or None)


_TRACING = ("estimate", "plan")
