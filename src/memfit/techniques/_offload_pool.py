"""What ``offload`` keeps apart from its hooks: counters, the host pool, storage helpers.

How activation offload works: ``memfit.techniques.offload`` and
docs/techniques/activation-offload.md; this file holds its bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.measure._counting import register_host_owner

__all__ = ["OffloadStats", "default_copy"]


@dataclass
class OffloadStats:
    """Counters of one ``OffloadHandle`` since ``apply``; bytes are bytes of saved tensors."""

    offloaded_bytes: int = 0        # bytes copied device -> host (a deduplicated save once)
    copies: int = 0                 # device -> host copies
    dedup_hits: int = 0             # saves served by an existing host copy (one per storage)
    device_copies: int = 0          # host -> device copies
    prefetched: int = 0             # of those, started ahead of need (the next block back)
    host_pool_bytes: int = 0        # host buffer bytes the pool holds now
    host_pool_peak_bytes: int = 0   # the most it has held


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view over the whole of ``t``'s storage (no copy; ``as_strided``, not
    ``set_``, which fake tensors would keep alive)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((n,), (1,), 0).view(torch.uint8)


def default_copy(src: torch.Tensor, out: torch.Tensor) -> None:
    """The default of both copies: ``out.copy_(src)``, non-blocking between host and CUDA."""
    out.copy_(src, non_blocking="cuda" in (src.device.type, out.device.type))


class _HostPool:
    """Reusable host buffers, best fit by bytes (else a new one of exactly the size), all freed
    when the last save using them is gone, so that each step's host bytes are born in it."""

    def __init__(self, stats: OffloadStats):
        self.stats = stats
        self._bufs: list[tuple[torch.Tensor, tuple]] = []   # (flat uint8 buffer, kind)
        self._free: set[int] = set()
        register_host_owner(self)    # buffers kept between steps: host memory to every tracker

    def host_tensors(self) -> list[torch.Tensor]:
        """The host buffers held now."""
        return [buf for buf, _ in self._bufs]

    def take(self, t: torch.Tensor, pinned: bool) -> tuple[int, torch.Tensor]:
        """(slot, a flat uint8 host tensor of ``t``'s bytes; ``t`` is a flat uint8 storage view)."""
        nbytes = t.numel()
        kind = (id(t.fake_mode) if isinstance(t, FakeTensor) else None, pinned)
        fits = [i for i in self._free
                if self._bufs[i][1] == kind and self._bufs[i][0].numel() >= nbytes]
        if fits:
            slot = min(fits, key=lambda i: (self._bufs[i][0].numel(), i))
            self._free.discard(slot)
        else:
            buf = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if pinned
                   else t.new_empty((nbytes,), dtype=torch.uint8, device="cpu"))
            self._bufs.append((buf, kind))
            slot = len(self._bufs) - 1
            self.stats.host_pool_bytes += nbytes
            self.stats.host_pool_peak_bytes = max(self.stats.host_pool_peak_bytes,
                                                  self.stats.host_pool_bytes)
        return slot, self._bufs[slot][0][:nbytes]

    def give(self, slot: int) -> None:
        self._free.add(slot)

    def trim(self) -> None:
        """Free every buffer; only called when none is in use."""
        assert len(self._free) == len(self._bufs), "trim with buffers in use"
        while self._bufs:              # the last made first (trace._step_log's order)
            self._bufs.pop()
        self._free = set()
        self.stats.host_pool_bytes = 0


def _same_view(a, t: torch.Tensor) -> bool:
    """``a`` is an alias of ``t`` (e.g. ``memfit.track``'s detached one): not transformed."""
    return isinstance(a, torch.Tensor) and a.untyped_storage()._cdata == \
        t.untyped_storage()._cdata and a.storage_offset() == t.storage_offset() and \
        a.shape == t.shape and a.stride() == t.stride() and a.dtype == t.dtype


def _is_wrapper(t: torch.Tensor) -> bool:
    """A wrapper subclass (e.g. DTensor) whose bytes live in inner tensors: kept on the device,
    not offloaded."""
    return hasattr(type(t), "__tensor_flatten__") and not isinstance(t, FakeTensor)
