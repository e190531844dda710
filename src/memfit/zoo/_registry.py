"""The built-in models as ``ModelSpec``s, found by name: one per row of ``memfit._zoo_table``
(real configs copied from the hub's config.json files), its config class resolved in
transformers.
"""

from __future__ import annotations

import transformers

from memfit._zoo_names import find_row, names, unknown_model
from memfit._zoo_table import ROWS, Row
from memfit.zoo._spec import ModelSpec

__all__ = ["find", "get", "names"]


def _spec(row: Row) -> ModelSpec:
    return ModelSpec(**{**row._asdict(), "config_class": getattr(transformers, row.config_class)})


_SPECS = {row.name: _spec(row) for row in ROWS}


def find(name: str) -> ModelSpec | None:
    """The built-in spec called ``name`` (canonical name or alias, case-insensitive), or ``None``."""
    row = find_row(name)
    return None if row is None else _SPECS[row.name]


def get(name: str) -> ModelSpec:
    """The built-in spec called ``name`` (canonical name or alias, case-insensitive)."""
    spec = find(name)
    if spec is None:
        raise unknown_model(name)
    return spec
