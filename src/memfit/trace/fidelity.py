"""Where a fake kernel's outputs differ from the real kernel's, make them agree.

A fake tensor's shape and dtype come from the op's meta function. Where a meta function and
the real CPU kernel disagree on an output's dtype or size, the fake trace would count other
bytes than the real step. Each rule below fixes one such op, names the real kernel it copies,
and is checked by a test that runs the real op beside the fake one.

Rule 1 (batch norm, mixed dtypes). Under autocast a conv hands batch norm a bf16/fp16 input
while its affine parameters and running stats stay fp32. The CPU kernel then computes in fp32
and returns ``save_mean``/``save_invstd`` in fp32 (``batch_norm_cpu``: ``param_scalar_type``
of a mixed-type call); the meta function returns them in the input's dtype.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FidelityMode"]

_aten = torch.ops.aten
_REDUCED = (torch.bfloat16, torch.float16)


def _batch_norm_mixed(args, kwargs, out):
    """Rule 1."""
    x, params = args[0], args[1:5]
    if x.dtype not in _REDUCED:
        return out
    if not any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params):
        return out
    y, mean, invstd = out
    return y, mean.to(torch.float32), invstd.to(torch.float32)


_RULES = {
    _aten.native_batch_norm.default: _batch_norm_mixed,
    _aten._native_batch_norm_legit.default: _batch_norm_mixed,
    _aten._native_batch_norm_legit_functional.default: None,
}
_RULES = {k: v for k, v in _RULES.items() if v is not None}


class FidelityMode(TorchDispatchMode):
    """Sits between the counter and the fake mode; rewrites outputs of the ops in ``_RULES``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rule = _RULES.get(func)
        return out if rule is None else rule(args, kwargs, out)
