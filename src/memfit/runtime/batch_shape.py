"""The batch a plan was made for: its shapes, the longest batch, and a batch larger than both.

Note 1 (``max_seq_len``: the longest batch without a tensor). With dynamic padding every batch
has its own length, and the plan must hold for the longest. ``extend_batch(batch, L)`` makes
the batch a plan is traced on: the example's sequence length ``S`` is dim 1 of the first of
``SEQ_KEYS`` it holds (``input_ids``, ``labels``, ``attention_mask``, ...); every tensor under
one of ``SEQ_KEYS`` gets each of its dims after the first (the batch dim, never extended) that
equals ``S`` set to ``L`` (a 4-D mask ``[B, 1, S, S]`` becomes ``[B, 1, L, L]``). Other tensors
(``pixel_values``, a per-sample scalar) pass through. Extended tensors are on the ``meta``
device: no memory, no values; the trace turns them into fakes of the model's device with the
same dtype and contiguous strides, so their bytes count as a real batch of length ``L`` would.
Values the step reads are decided by the real example: an all-ones mask is dropped first
(``prepare_batch``: the longest batch is unpadded), a mask with zeros stays (as a meta tensor
the trace keeps it: the padded branch, the more conservative one). A non-Mapping batch, or
``L`` below ``S``, is an error naming the fix.

Note 2 (a batch larger than planned). ``BatchShapes`` holds the planned batch's tensor shapes
(the example's, or the extended ones of Note 1). ``Runner.step`` asks it about each batch:
a tensor with any dim above the planned one (a longer sequence, more samples) makes one
warning per new shape signature, naming the planned and the new shape and the fix. Shapes are
compared per key of a Mapping (positionally for other pytrees); a key the plan never saw is not
compared. Only host-side shape tuples are read: no sync, nothing kept alive.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["SEQ_KEYS", "BatchShapes", "extend_batch", "seq_len_of"]

# the inputs whose dims of the sequence length are extended (Note 1), in the order S is read
SEQ_KEYS = ("input_ids", "labels", "attention_mask", "token_type_ids", "position_ids",
            "decoder_input_ids", "decoder_attention_mask", "inputs_embeds", "special_tokens_mask")


def seq_len_of(batch) -> int:
    """The example's sequence length ``S`` (Note 1)."""
    if not isinstance(batch, Mapping):
        raise ValueError(f"max_seq_len needs a Mapping batch (input_ids, labels, ...), not a "
                         f"{type(batch).__name__}: pass the longest batch as the example instead")
    for key in SEQ_KEYS:
        t = batch.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[1])
    raise ValueError(f"max_seq_len: the batch has none of {', '.join(SEQ_KEYS)} as a tensor "
                     f"[batch, seq, ...] (its keys: {sorted(batch)}), so its sequence length is "
                     "unknown: pass the longest batch as the example instead")


def extend_batch(batch, max_seq_len: int) -> dict:
    """``batch`` with its sequence dims at ``max_seq_len``, extended tensors on ``meta``."""
    if type(max_seq_len) is not int or max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len!r} must be an int >= 1 (tokens)")
    s = seq_len_of(batch)
    if max_seq_len < s:
        raise ValueError(f"max_seq_len={max_seq_len} is shorter than the example batch ({s} "
                         f"tokens): give at least {s}, or a shorter example")
    out = dict(batch)
    if max_seq_len == s:
        return out
    for key in SEQ_KEYS:
        t = out.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            shape = [t.shape[0], *(max_seq_len if d == s else d for d in t.shape[1:])]
            out[key] = torch.empty(shape, dtype=t.dtype, device="meta",
                                   requires_grad=t.requires_grad)
    return out


def _shapes(batch):
    """{key: shape} of a Mapping's tensors, else [shape or None] of the pytree's leaves."""
    if isinstance(batch, Mapping):
        return {k: tuple(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else None
            for x in tree_flatten(batch)[0]]


class BatchShapes:
    """The planned batch's shapes; warns once per new shape of a larger batch (Note 2)."""

    def __init__(self, planned):
        self.planned = _shapes(planned)
        self._warned: set = set()

    def larger(self, batch) -> list[tuple[str, tuple, tuple]]:
        """(name, planned shape, shape) of each tensor of ``batch`` above the planned one."""
        now, out = _shapes(batch), []
        pairs = now.items() if isinstance(now, dict) else enumerate(now)
        for key, shape in pairs:
            if isinstance(self.planned, dict):
                was = self.planned.get(key)
            else:
                was = self.planned[key] if key < len(self.planned) else None
            if shape is None or was is None or len(shape) != len(was):
                continue
            if any(a > b for a, b in zip(shape, was)):
                out.append((str(key), was, shape))
        return out

    def check(self, batch) -> None:
        """Warn if ``batch`` is larger than planned, once per new shape signature."""
        larger = self.larger(batch)
        signature = tuple((k, s) for k, _, s in larger)
        if not larger or signature in self._warned:
            return
        self._warned.add(signature)
        what = "; ".join(f"{k} {_fmt(s)} (planned {_fmt(p)})" for k, p, s in larger)
        longer = [s[1] for _, p, s in larger if len(s) >= 2 and s[1] > p[1]]
        fixes = []
        if longer:
            fixes.append(f"with dynamic padding, plan for the longest batch: memfit.fit(..., "
                         f"max_seq_len={max(longer)}) (or the longest batch as the example)")
        if any(s[0] > p[0] for _, p, s in larger if s):
            fixes.append("for more samples, give fit the largest batch as the example")
        warnings.warn(
            f"memfit: this batch is larger than the one the plan was made for: {what}. The "
            "plan's predictions and budget hold only up to the planned shape, so it may run out "
            f"of memory: {'; '.join(fixes) or 'plan for this batch'}.", stacklevel=3)


def _fmt(shape: tuple) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"
