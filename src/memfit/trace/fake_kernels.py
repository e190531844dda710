"""Fake kernels for aten ops that have none, registered through ``torch.library.register_fake``.

A fake tensor's outputs come from the op's meta or fake kernel; an op without one stops a trace
(``UnsupportedOperatorException``). Each kernel here allocates the outputs the real kernel
allocates (size, strides, dtype), read from its source, so the counter counts the real bytes.
Scratch that a kernel frees before it returns is not an output and is not counted: the trace
counts live bytes at op boundaries, like ``memfit.track``.

Note 1 (CTC loss). ``F.ctc_loss`` reaches ``aten._ctc_loss`` (Wav2Vec2, HuBERT, ...'s CTC heads). On
plain tensors ``ctc_loss`` reads the lengths back and calls the ``int[]`` overload; on a tensor
subclass (a fake, or any tensor under a dispatch mode) it calls ``_ctc_loss.Tensor``, whose kernel
does the same read (``ctc_loss_tensor`` in aten/src/ATen/native/LossCTC.cpp). The ``int[]``
overloads are given fake kernels here; the ``.Tensor`` ones are resolved from the lengths' real
values by ``data_dependent.DataValues`` (it runs them on the real lengths), and refused as
data-dependent where those values are unknown. ``ctc_loss_allocate_outputs`` (CPU) and
``ctc_loss_gpu_template`` (aten/src/ATen/native/cuda/LossCTC.cu) both return ``neg_log_likelihood``
(batch,) and ``log_alpha`` (batch, T, 2 * max(target_lengths) + 1), contiguous, in the dtype of
``log_probs``; both backwards return ``grad = full_like(log_probs, -inf,
LEGACY_CONTIGUOUS_MEMORY_FORMAT)``, a contiguous (T, batch, classes) tensor whatever the strides of
``log_probs`` (``log_beta``, the size of ``log_alpha``, is scratch freed inside the op). An
unbatched (T, classes) input was unsqueezed to a batch of one before the op.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

__all__ = ["ctc_loss_fake", "ctc_loss_backward_fake"]


@torch.library.register_fake("aten::_ctc_loss")
def ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank=0,
                  zero_infinity=False):
    """Note 1: ``(neg_log_likelihood, log_alpha)`` as ``ctc_loss_allocate_outputs`` makes them."""
    _check_ctc(log_probs, input_lengths, target_lengths, blank)
    batch, max_target = log_probs.size(1), max(target_lengths, default=0)
    nll = log_probs.new_empty((batch,))
    log_alpha = log_probs.new_empty((batch, log_probs.size(0), 2 * max_target + 1))
    return nll, log_alpha


@torch.library.register_fake("aten::_ctc_loss_backward")
def ctc_loss_backward_fake(grad, log_probs, targets, input_lengths, target_lengths,
                           neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    """Note 1: ``full_like(log_probs, -inf, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``."""
    return log_probs.new_empty(log_probs.shape)


def _lengths_unknown(*args, **kwargs):
    """Note 1: the ``.Tensor`` overloads need the lengths' values, which a fake does not hold."""
    raise DataDependentOutputException(torch.ops.aten._ctc_loss.Tensor)


torch.library.register_fake("aten::_ctc_loss.Tensor", _lengths_unknown)
torch.library.register_fake("aten::_ctc_loss_backward.Tensor", _lengths_unknown)


def _check_ctc(log_probs, input_lengths, target_lengths, blank) -> None:
    """The argument checks of ``ctc_loss_allocate_outputs`` that a wrong batch would trip."""
    if log_probs.dim() != 3:
        raise RuntimeError(f"ctc_loss: log_probs must be 3-D (T, batch, classes), got "
                           f"{tuple(log_probs.shape)}")
    batch, classes = log_probs.size(1), log_probs.size(2)
    if not 0 <= blank < classes:
        raise RuntimeError(f"ctc_loss: blank {blank} is not in the label range [0, {classes})")
    if len(input_lengths) != batch or len(target_lengths) != batch:
        raise RuntimeError(f"ctc_loss: input_lengths and target_lengths must have one entry per "
                           f"sample ({batch}), got {len(input_lengths)} and {len(target_lengths)}")
    if any(n < 0 or n > log_probs.size(0) for n in input_lengths):
        raise RuntimeError(f"ctc_loss: input_lengths must lie in [0, {log_probs.size(0)}], got "
                           f"{list(input_lengths)}")
