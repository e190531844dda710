"""transformers' ``is_tracing(tensor)``, answered for a trace that holds the tensor's real values.

Note 1 (the question). transformers decides whether to build a 4-D attention mask by reading
the caller's 2-D mask: with no padding (an all-ones mask) and SDPA, ``masking_utils`` returns no
mask and lets the kernel's ``is_causal`` do the work (``_ignore_causal_mask_sdpa``,
``_ignore_bidirectional_mask_sdpa``, ``find_packed_sequence_indices``, the ``torch.all(mask ==
1)`` shortcut); ``modeling_utils`` checks the padding of ``input_ids``. Each read is guarded by
``is_tracing(mask)``, which is true for any ``FakeTensor`` (``import_utils.is_fake_tensor``),
because a compiler's fake has no values to read. Under memfit's trace every such guard took the
traced branch: the 4-D mask was built (a B x 1 x L x L tensor, and SDPA ran with it) where the
real step builds none. Bart's decoder, and OPT under a user's step, counted those bytes too many.

Note 2 (the answer). A fake whose real values the trace holds (``DataValues``: the batch's ids,
labels and masks, and what is computed from them alone) is not a value the trace lacks: the real
step reads it, and the trace can read it the same way, since the reads (``mask.all()``,
``mask.sum() == n``, then ``bool``) are mirrored on the real values and ``.item()`` is resolved from
them (``DataValues.resolve``). So while a trace runs, ``known_values_readable(data)`` makes
transformers' ``is_fake_tensor`` answer "no" for such a fake, and what it answered before for
anything else: the guard then takes the real step's branch, with the real step's ops. transformers
has no hook for this question, so the one predicate behind every ``is_tracing(tensor)`` is replaced
for the trace's duration and restored after it (nested traces share one replacement, counted); the
user's real step never runs under it. A fake too large for its reads to be mirrored
(``MAX_KNOWN_ELEMENTS``) stays "tracing".
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.trace.data_dependent import MAX_KNOWN_ELEMENTS, DataValues

__all__ = ["known_values_readable"]

_IMPORT_UTILS = "transformers.utils.import_utils"
_lock = threading.Lock()
_active: list[DataValues] = []        # the DataValues of the traces running now (Note 2)
_original = None                      # transformers' own is_fake_tensor while replaced


def _readable(t) -> bool:
    """Whether a running trace holds ``t``'s real values and can mirror a read of all of them
    (a reduction or a slice reads ``numel`` elements and writes up to as many)."""
    return (isinstance(t, FakeTensor) and any(data.real(t) is not None for data in list(_active))
            and 2 * t.numel() <= MAX_KNOWN_ELEMENTS)       # known, so of plain sizes (no guard)


def _is_fake_tensor(x) -> bool:
    """transformers' ``is_fake_tensor``, except for a fake whose values the trace reads (Note 2)."""
    if isinstance(x, torch.Tensor) and _readable(x):
        return False
    return _original(x)


@contextlib.contextmanager
def known_values_readable(data: DataValues):
    """While active, transformers' ``is_tracing(t)`` is false for a fake ``t`` with known values
    in ``data`` (Note 2). Does nothing where transformers is not imported."""
    global _original
    module = sys.modules.get(_IMPORT_UTILS)
    if module is None or not hasattr(module, "is_fake_tensor"):
        yield
        return
    with _lock:
        if not _active:
            _original = module.is_fake_tensor
            module.is_fake_tensor = _is_fake_tensor
        _active.append(data)
    try:
        yield
    finally:
        with _lock:
            _active.remove(data)
            if not _active:
                module.is_fake_tensor = _original
                _original = None
