"""Byte quantities: parse ``"11GiB"`` / ``"10.5 GB"`` / ``12345`` into ints and format them back.

Note 1 (bare numbers). A number with no unit is a count of bytes, but ``"11"`` is almost always
someone meaning 11 GiB: no training step fits in 11 bytes. So a *string* (or float) without a
unit below 1 MiB (but above 0, which is 0 in any unit) is refused with the fix; write the unit,
or ``"11B"`` / ``"11 bytes"`` when you do mean bytes. A Python ``int`` is bytes by definition in
the API and always passes through; ``bare_count`` tells such an int apart, for a refusal that
may name the unit it likely lacks.
"""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes", "bare_count", "GiB", "MiB", "KiB", "UNITS_HELP"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

UNITS_HELP = ("decimal units are powers of 10 (kB = 10^3, MB = 10^6, GB = 10^9 bytes), binary "
              "units powers of 2 (KiB = 2^10, MiB = 2^20, GiB = 2^30 bytes); B or 'bytes' for "
              "plain bytes")


def _bare_too_small(text: str, n: float) -> ValueError:
    return ValueError(
        f"{text!r} has no unit, so it reads as {n:g} bytes, which no training step fits in "
        f"(under 1 MiB): write a unit, e.g. '{text.strip()}GiB' or '{text.strip()}GB' "
        f"({UNITS_HELP}), or '{text.strip()}B' if you do mean bytes")


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Ints are bytes and pass through (never negative). Strings take a number and an optional
    unit, case-insensitive: decimal ``kB``/``MB``/``GB``/``TB`` (10^3, 10^6, 10^9, 10^12),
    binary ``KiB``/``MiB``/``GiB``/``TiB`` (2^10, 2^20, 2^30, 2^40), or ``B``/``bytes``.
    A string or float with no unit is bytes too, but one under 1 MiB (other than 0) is refused
    as a likely missing unit (Note 1): ``parse_bytes("11")`` raises, ``parse_bytes("11B")`` and
    ``parse_bytes(11)`` are 11.
    """
    if isinstance(value, bool):
        raise ValueError(f"a byte size must be a number or a string like '11GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value or value == float("inf"):
            raise ValueError(f"a byte size must be a finite non-negative number, got {value}")
        if 0 < value < MiB:
            raise _bare_too_small(repr(value), value)
        return int(value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"cannot read {value!r} as a size in bytes: write a number and a unit, "
                f"e.g. '11GiB', '10.5 GB' or '512MiB' ({UNITS_HELP})"
            )
        number = float(match.group(1))
        if number < 0:
            raise ValueError(f"a byte size cannot be negative, got {value!r}")
        if number == float("inf"):
            raise ValueError(f"a byte size must be finite, got {value!r}")
        if unit == "" and 0 < number < MiB:
            raise _bare_too_small(match.group(1), number)
        return int(number * _UNITS[unit])
    raise ValueError(f"a byte size must be an int or a string like '11GiB', got {type(value).__name__}")


def bare_count(value) -> bool:
    """Whether ``value`` was given as an int, a count of bytes with no unit (Note 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def format_bytes(n: int | float, precision: int = 2) -> str:
    """``format_bytes(11 * GiB) == '11.00 GiB'``; binary units, sign kept."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"
