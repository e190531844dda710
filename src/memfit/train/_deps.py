"""The optional libraries of ``memfit train``, imported on first use, with an error naming
the fix.

memfit itself does not need Hugging Face ``datasets`` or ``tokenizers``; only ``memfit train``
does, so they are imported here, when a run starts, never at ``import memfit``.
"""

from __future__ import annotations

import importlib

__all__ = ["require", "INSTALL_HINT", "MissingDependency"]

INSTALL_HINT = "pip install 'memfit[train]'"


class MissingDependency(ImportError, ValueError):
    """An optional library is not installed. An ImportError (what it is), and a ValueError so
    the command line shows its one line with the fix, not a traceback."""


def require(name: str):
    """The module ``name`` (``datasets`` or ``tokenizers``), or MissingDependency with the fix."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependency(f"memfit train needs the {name!r} package, which is not installed: "
                          f"{INSTALL_HINT} (or pip install {name})") from e
