"""The ``--json`` objects: byte counts are never negative (a shortfall has its own key)."""

from __future__ import annotations

__all__ = ["spare_and_short", "byte_counts_checked"]


def spare_and_short(d: dict) -> dict:
    """``headroom_bytes`` (negative when short) -> ``spare_bytes`` and ``short_bytes``, both >= 0."""
    out = dict(d)
    headroom = out.pop("headroom_bytes", None)
    if headroom is not None:
        out["spare_bytes"], out["short_bytes"] = max(headroom, 0), max(-headroom, 0)
    return out


def _increase(value):
    """An increase in bytes (e.g. what the optimizer step adds on top of what is live before
    it) is at least 0: a step that frees more than it allocates adds nothing."""
    return value if value is None else max(value, 0)


def byte_counts_checked(obj, path: str = ""):
    """``obj`` with every ``*_bytes`` count checked to be >= 0 (``predicted_optimizer_step_bytes``
    is an increase: clamped to 0)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k == "predicted_optimizer_step_bytes":
                v = _increase(v)
            out[k] = byte_counts_checked(v, f"{path}.{k}")
        return out
    if isinstance(obj, list):
        return [byte_counts_checked(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool) and path.endswith("_bytes"):
        assert obj >= 0, f"negative byte count in the JSON at {path}: {obj}"
    return obj
