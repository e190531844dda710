"""Which blocks a per-block technique (recompute, offload) applies to, from its policy."""

from __future__ import annotations

import warnings

from torch import nn

from memfit.measure import find_blocks
from memfit.modes import Mode

__all__ = ["resolve_policy", "check_names"]


def resolve_policy(model: nn.Module, policy, mode: Mode | str, technique: str
                   ) -> dict[str, Mode]:
    """Block name -> ``mode`` or ``Mode.KEEP``, blocks in execution order.

    ``policy``: "none", "all", "selective" (``Mode.SELECTIVE``), "every:K" (blocks counted from
    1, every K-th: indices K-1, 2K-1, ..., as torchtitan's ``ac_freq``), or a tuple of the
    qualified names of modules (any module of the model, not only its blocks); for recompute a
    name may end in ":selective" to recompute that block selectively (a planner's mixed plan).
    """
    mode = Mode.parse(mode)
    blocks = find_blocks(model)
    if isinstance(policy, tuple):
        chosen = dict(_split_entry(n, mode) for n in policy)
        check_names(model, list(chosen), blocks)
        return {b: Mode.KEEP for b in blocks} | chosen
    if policy == "none":
        return {b: Mode.KEEP for b in blocks}
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks for policy={policy!r}: no module "
            "is a transformers GradientCheckpointingLayer, and no ModuleList/Sequential holds "
            "children of one type. Pass the qualified names of your own modules as a tuple, "
            f"e.g. {technique}.Config(policy=('encoder.0', 'encoder.1'))")
    if policy in ("all", "selective"):
        return {b: Mode.SELECTIVE if policy == "selective" else mode for b in blocks}
    k = int(policy[len("every:"):])
    if k > len(blocks):
        verb = {Mode.RECOMPUTE: "recomputes", Mode.OFFLOAD: "offloads"}.get(mode, "applies to")
        warnings.warn(f"policy={policy!r} {verb} nothing: {type(model).__name__} has only "
                      f"{len(blocks)} blocks (use every:K with K <= {len(blocks)})", stacklevel=3)
    return {b: mode if i % k == k - 1 else Mode.KEEP for i, b in enumerate(blocks)}


def check_names(model: nn.Module, names, blocks: list[str] | None = None) -> None:
    """Every name must be a submodule's qualified name; else list the blocks."""
    modules = dict(model.named_modules())
    containers = [n for n in names if isinstance(modules.get(n), (nn.ModuleList, nn.ModuleDict))]
    if containers:
        raise ValueError(f"{containers} name containers, whose forward never runs: name their "
                         f"children instead, e.g. '{containers[0]}.0'")
    unknown = [n for n in names if n not in modules or n == ""]
    if unknown:
        blocks = find_blocks(model) if blocks is None else blocks
        raise ValueError(
            f"{unknown} match no submodule of {type(model).__name__}: its blocks are "
            f"{blocks or 'none'} (use qualified names as in model.named_modules(), "
            "e.g. 'model.layers.0')")


def _split_entry(entry: str, mode: Mode) -> tuple[str, Mode]:
    """"name" -> (name, mode); "name:selective" -> (name, ``Mode.SELECTIVE``) where mode is
    recompute (the one suffix of the policy language)."""
    name, sep, flavour = entry.partition(":")
    if not sep:
        return name, mode
    if flavour != Mode.SELECTIVE or mode != Mode.RECOMPUTE:
        allowed = "; 'name:selective' selects selective recompute" \
            if mode == Mode.RECOMPUTE else ""
        raise ValueError(f"{entry!r}: a {mode} entry is a module's qualified name{allowed}")
    return name, Mode.SELECTIVE
