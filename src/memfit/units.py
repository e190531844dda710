"""Byte quantities: parse ``"11GiB"`` / ``"10.5 GB"`` / ``12345`` into ints and format them back."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes", "GiB", "MiB", "KiB"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Ints pass through; strings take a number and an optional unit: decimal (``kB``, ``MB``,
    ``GB``, ``TB``) or binary (``KiB``, ``MiB``, ``GiB``, ``TiB``), case-insensitive.
    """
    if isinstance(value, bool):
        raise ValueError(f"a byte size must be a number or a string like '11GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value:
            raise ValueError(f"a byte size must be a non-negative number, got {value}")
        return int(value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {value!r} as a size in bytes: write a number and a unit, "
                "e.g. '11GiB', '10.5 GB', '512MiB' or a plain integer of bytes"
            )
        return int(float(match.group(1)) * _UNITS[unit])
    raise ValueError(f"a byte size must be an int or a string like '11GiB', got {type(value).__name__}")


def format_bytes(n: int | float, precision: int = 2) -> str:
    """``format_bytes(11 * GiB) == '11.00 GiB'``; binary units, sign kept."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"
