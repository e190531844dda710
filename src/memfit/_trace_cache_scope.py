"""Which cache ``memfit.estimate`` reads and keeps its answers in, set by a front.

A context variable, and nothing heavy: the CLI enters ``using(cache)`` around a subcommand
before it imports torch, so a refusal still answers at once (``api._trace_cache`` keys and
reads; docs/cache.md)."""

from __future__ import annotations

import contextlib
import contextvars

__all__ = ["using", "current"]

_CACHE: contextvars.ContextVar = contextvars.ContextVar("memfit_trace_cache", default=None)


@contextlib.contextmanager
def using(cache):
    """Estimates inside read and write ``cache`` (a ``memfit._cache.Cache``; None: none)."""
    token = _CACHE.set(cache)
    try:
        yield cache
    finally:
        _CACHE.reset(token)


def current():
    """The cache a front entered, or None."""
    return _CACHE.get()
