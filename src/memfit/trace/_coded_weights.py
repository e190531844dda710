"""Whether a model holds weights in integer codes: a base quantized by bitsandbytes (its 4-bit
``Params4bit`` packs two codes a byte, its 8-bit ``Int8Params``), which a trace and a refusal
treat apart from float weights."""

from __future__ import annotations

from torch import nn

__all__ = ["holds_coded_weights"]


def holds_coded_weights(model: nn.Module) -> bool:
    return any(not p.is_floating_point() for p in model.parameters())
