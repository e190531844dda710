"""memfit: make a PyTorch training step fit the GPU memory you have.

Names are imported on first use (PEP 562 ``__getattr__``), so ``import memfit.cli`` (and
``memfit --help``) does not pay for importing torch; ``from memfit import plan`` and
``memfit.plan`` work as they always did.
"""

from __future__ import annotations

import importlib
import importlib.util

# public name -> the module that defines it
_LAZY = {
    "Estimate": "memfit.api", "estimate": "memfit.api.front", "fit": "memfit.api.front",
    "largest_fitting": "memfit.api", "plan": "memfit.api.front", "progressive": "memfit.studies",
    "what_if": "memfit.studies", "remat": "memfit.api.remat",
    "estimate_sharded": "memfit.api._sharded",
    "DeviceSpec": "memfit.devices", "get_device": "memfit.devices", "list_devices": "memfit.devices",
    "BudgetTooSmall": "memfit.errors", "OutOfMemory": "memfit.errors", "TraceError": "memfit.errors",
    "ReplanError": "memfit.errors", "MemfitDeprecationWarning": "memfit.errors",
    "Job": "memfit.job", "Knobs": "memfit.knobs", "Mode": "memfit.modes",
    "Tracker": "memfit.measure", "track": "memfit.measure",
    "Plan": "memfit.planner", "Runner": "memfit.runtime", "StepInfo": "memfit.runtime",
    "format_bytes": "memfit.units", "parse_bytes": "memfit.units",
}

__all__ = sorted(_LAZY)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY and not name.startswith("_") and \
            importlib.util.find_spec(f"memfit.{name}") is not None:
        return importlib.import_module(f"memfit.{name}")    # memfit.zoo after `import memfit`
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value      # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
