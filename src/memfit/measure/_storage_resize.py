"""Storage resizes no dispatch mode sees, counted while a tracker runs.

Note 1 (why a wrapper). ``UntypedStorage.resize_`` changes a storage's size in place without
dispatching an aten op (it is a method of the storage, not of a tensor), so ``CountingMode``
never sees it. FSDP2 frees and re-allocates every unsharded parameter that way
(``_fsdp_param.free_storage`` / ``alloc_storage``: resize to 0 after use, to the full size
before the next all-gather): without this a tracker would count each unsharded parameter as
alive from the region's start at its full size, and never its free. PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` wraps the method for the same reason
(``_track_resize``). Here the wrapper is installed when the first tracker enters and removed
when the last one exits (``resizes_counted``); each call is reported to every running tracker
of the storage's device kind: a counted storage is resized in its ledger, one not counted yet
that now holds bytes is counted from here on as a temporary.
"""

from __future__ import annotations

import contextlib

import torch

from memfit.measure import _ledger as L

__all__ = ["resizes_counted"]

_ORIGINAL = torch.UntypedStorage.resize_
_OWN = "resize_" in vars(torch.UntypedStorage)     # else inherited from the C base class
_depth = 0
_trackers: list = []         # the running trackers (track's own list, given on entry)


def _resize(storage, nbytes):
    out = _ORIGINAL(storage, nbytes)
    for tracker in _trackers:
        led = tracker.ledger
        kind = storage.device.type
        if (kind == "meta") != led.fake or kind not in (led.device_type, "meta"):
            continue
        if led.sid(storage) is not None:
            led.resize(storage)
        elif storage.nbytes() > 0:
            led.add(storage, L.TEMPORARIES, entry=False)
    return out


@contextlib.contextmanager
def resizes_counted(running: list):
    """While entered (re-entrant), ``UntypedStorage.resize_`` reports to the trackers in
    ``running`` (track's list of those inside their ``with`` block)."""
    global _depth, _trackers
    _trackers = running
    if _depth == 0:
        torch.UntypedStorage.resize_ = _resize
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            if _OWN:
                torch.UntypedStorage.resize_ = _ORIGINAL
            else:
                del torch.UntypedStorage.resize_      # the C base's method shows through again
