"""A replay model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, 2.6-2.13).

Replay a step's storage mallocs and frees; read what ``torch.cuda`` would report as
``max_memory_allocated`` / ``max_memory_reserved`` and how much is cached but unused.

Note 1: sizes. ``round_size`` rounds requests up to ``kMinBlockSize`` (512 B). Rounded sizes
<= ``kSmallSize`` (1 MiB) use the small pool, others the large pool. A new segment (one cudaMalloc)
is ``get_allocation_size``: ``kSmallBuffer`` (2 MiB) for the small pool, ``kLargeBuffer`` (20 MiB)
below ``kMinLargeAlloc`` (10 MiB), else the size rounded up to ``kRoundLarge`` (2 MiB).
``roundup_power2_divisions`` (off by default) is not modelled.

Note 2: best fit, split, merge. Free blocks are ordered by (stream, size, address); a request takes
the first with size >= request (``get_free_block``). With ``max_split_size`` set, a request below
it never takes a block at or above it, and a larger request takes a block only if it is below
request + ``kLargeBuffer`` (``max_non_split_rounding``). ``should_split``: the small pool, and any
pool with expandable segments, splits off a remainder >= 512 B; the large pool only a remainder
> ``kSmallSize``, and only if the *request* is below ``max_split_size``. An unsplit block counts
whole in allocated bytes. ``free_block`` merges with free neighbours (``try_merge_blocks``).

Note 3: counting. Allocated = sizes of blocks in use (``memory_allocated``: rounded, not requested).
Reserved = cudaMalloc'd segments + pages mapped in expandable segments. Peaks update at every
increase, like ``increase_stat``.

Note 4: out of memory. A new segment that would pass ``capacity_bytes`` (the memory the allocator
may hold: device memory less context and other processes) makes malloc (a) with
``max_split_size`` set, free cached unsplit oversize blocks (``release_available_cached_blocks``),
then (b) free every wholly free segment and unmap free pages (``release_cached_blocks``, as
``empty_cache`` does) and retry once; then raise ``AllocatorOOM``.

Note 5: simplifications. Addresses are fake and grow with each segment, so best-fit ties go to
the older segment. Blocks are free at once: no cross-stream events, CUDA graphs, private pools,
garbage collection. An expandable segment spans ``_ADDRESS_SPACE_BYTES``, not 1.125 x device
memory. A 0-byte request takes no memory and is not counted (``allocate`` never mallocs it).

Expandable segments (``expandable_segments:True``: one growing segment per pool and stream,
whose pages are mapped on demand) are served by ``_allocator_expandable``; its note says how.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from memfit.trace._allocator_blocks import (
    _UNLIMITED, K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_SIZE, _Block, _expandable_size, _Pool,
    _round_up, _Segment, _splice, round_size, segment_size)
from memfit.trace._allocator_expandable import ExpandableSegments

__all__ = ["AllocatorConfig", "AllocatorOOM", "AllocatorStats", "CachingAllocator",
           "replay", "round_size", "segment_size"]


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings that change memory use."""

    expandable_segments: bool = False
    """``expandable_segments:True``: one growing segment per pool and stream, its pages mapped
    on demand (``_allocator_expandable``)."""
    max_split_size_bytes: int | None = None
    """``max_split_size_mb`` in bytes; None is PyTorch's default, unlimited. Must exceed 20 MiB."""
    capacity_bytes: int | None = None
    """Bytes the allocator may reserve in all (Note 4); None = unlimited."""

    def __post_init__(self) -> None:
        if self.max_split_size_bytes is not None and self.max_split_size_bytes <= K_LARGE_BUFFER:
            raise ValueError(f"max_split_size_bytes must be > {K_LARGE_BUFFER} (20 MiB), as "
                             "PyTorch requires of max_split_size_mb; got "
                             f"{self.max_split_size_bytes}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0 or None, got {self.capacity_bytes}")


@dataclass
class AllocatorStats:
    """Counters as ``torch.cuda.memory_stats`` keeps them (all bytes are rounded block sizes)."""

    allocated_bytes: int  # in use now (memory_allocated)
    reserved_bytes: int  # held from the device now (memory_reserved)
    max_allocated_bytes: int  # peak of allocated_bytes (max_memory_allocated)
    max_reserved_bytes: int  # peak of reserved_bytes (max_memory_reserved)
    num_segments: int  # live segments: cudaMalloc'd ones plus expandable ones
    num_allocs: int  # non-empty mallocs so far
    num_frees: int  # frees of non-empty blocks so far
    max_reserved_minus_allocated_bytes: int = 0  # most reserved-but-unused after any call
    num_alloc_retries: int = 0  # mallocs that had to release the cache first (Note 4)

    @property
    def fragmentation_at_peak(self) -> float:
        """Share of the reserved peak that the allocated peak does not explain, in [0, 1)."""
        if self.max_reserved_bytes == 0:
            return 0.0
        return 1.0 - self.max_allocated_bytes / self.max_reserved_bytes


class AllocatorOOM(MemoryError):
    """A request could not be met even after releasing the cache. All attributes are bytes."""

    def __init__(self, *, requested_bytes: int, segment_bytes: int, allocated_bytes: int,
                 reserved_bytes: int, capacity_bytes: int | None):
        self.requested_bytes = requested_bytes
        self.segment_bytes = segment_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.capacity_bytes = capacity_bytes
        idle = reserved_bytes - allocated_bytes
        super().__init__(
            f"allocator model out of memory: a {requested_bytes} B block needs a new "
            f"{segment_bytes} B segment; capacity {capacity_bytes} B, allocated "
            f"{allocated_bytes} B, reserved {reserved_bytes} B ({idle} B of it cached in split "
            "segments, so not releasable). Lower the peak (smaller batch, checkpointing) or, if "
            "the cached part is large, try expandable_segments=True.")


class CachingAllocator(ExpandableSegments):
    """Replays mallocs and frees the way the CUDA caching allocator serves them (module notes)."""

    def __init__(self, config: AllocatorConfig = AllocatorConfig()):
        self.config = config
        self._max_split = config.max_split_size_bytes or _UNLIMITED
        self._small, self._large = _Pool(is_small=True), _Pool(is_small=False)
        self._live: dict[int, _Block | None] = {}
        self._handles = itertools.count(1)
        self._next_addr = 1 << 32
        self._expandable: list[_Segment] = []
        self._num_malloc_segments = self._allocated = self._reserved = 0
        self._max_allocated = self._max_reserved = self._max_idle = 0
        self._num_allocs = self._num_frees = self._num_retries = 0

    @property
    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            self._allocated, self._reserved, self._max_allocated, self._max_reserved,
            self._num_malloc_segments + len(self._expandable), self._num_allocs, self._num_frees,
            self._max_idle, self._num_retries)

    @property
    def allocated_bytes(self) -> int:
        """Bytes in allocated blocks now (``stats.allocated_bytes``, without building stats:
        a replay reads it after every event)."""
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved from the device now (``stats.reserved_bytes``)."""
        return self._reserved

    def block_of(self, handle: int) -> tuple[int, int] | None:
        """(address, block bytes) of a live allocation; None for a zero-byte one."""
        block = self._live[handle]
        return None if block is None else (block.addr, block.size)

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Allocate ``nbytes`` on ``stream``; returns a handle for ``free``."""
        size, handle = round_size(nbytes), next(self._handles)
        if size == 0:
            self._live[handle] = None
            return handle
        pool = self._small if size <= K_SMALL_SIZE else self._large
        block = self._get_free_block(pool, size, stream)
        if block is None:
            block = self._alloc_block(pool, size, stream)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, stream)
        if block is None:
            self._num_retries += 1
            self._release_cached_blocks()
            block = self._alloc_block(pool, size, stream)
        if block is None:
            self._sample_idle()
            raise AllocatorOOM(requested_bytes=size, segment_bytes=segment_size(size),
                               allocated_bytes=self._allocated, reserved_bytes=self._reserved,
                               capacity_bytes=self.config.capacity_bytes)
        if self._should_split(block, size):  # alloc_found_block (Note 2)
            rest = _Block(block.addr + size, block.size - size, pool, stream, block.segment)
            _splice(rest, block, block.next)
            block.size = size
            pool.blocks.add(rest)
        block.allocated = True
        self._allocated += block.size
        self._max_allocated = max(self._max_allocated, self._allocated)
        self._live[handle] = block
        self._num_allocs += 1
        self._sample_idle()
        return handle

    def free(self, handle: int) -> None:
        """Return the block of ``handle`` to its pool, merged with free neighbours (Note 2)."""
        if handle not in self._live:
            raise ValueError(f"handle {handle} is not live: never allocated, or already freed")
        block = self._live.pop(handle)
        if block is None:
            return
        block.allocated = False
        self._allocated -= block.size
        self._num_frees += 1
        for neighbour in (block.prev, block.next):
            self._try_merge(block, neighbour)
        block.pool.blocks.add(block)
        self._sample_idle()

    def empty_cache(self) -> None:
        """Release wholly free segments and unmap free expandable pages (``emptyCache``)."""
        self._release_cached_blocks()
        self._sample_idle()

    def snapshot(self) -> list[list[tuple[int, bool]]]:
        """Each segment's mapped blocks in address order as (size_bytes, allocated)."""
        blocks = [b for b in self._live.values() if b is not None]
        for pool in (self._small, self._large):
            blocks += list(pool.blocks) + list(pool.unmapped)
        segments = []
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.addr):
            seg, b = [], head
            while b is not None:
                if b.mapped:
                    seg.append((b.size, b.allocated))
                b = b.next
            segments.append(seg)
        return segments

    # -- internals, named after their C++ counterparts ------------------------------------------

    def _sample_idle(self) -> None:
        self._max_idle = max(self._max_idle, self._reserved - self._allocated)

    def _grow_reserved(self, nbytes: int) -> bool:
        cap = self.config.capacity_bytes
        if cap is not None and self._reserved + nbytes > cap:
            return False
        self._reserved += nbytes
        self._max_reserved = max(self._max_reserved, self._reserved)
        return True

    def _new_address(self, nbytes: int) -> int:
        addr, self._next_addr = self._next_addr, self._next_addr + _round_up(nbytes, K_LARGE_BUFFER)
        return addr

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        blocks = pool.blocks
        i = blocks.lower_bound((stream, size, -1))
        if i == len(blocks) or blocks.at(i).stream != stream:
            return None
        # in an expandable segment a free block before unmapped space counts as bigger
        while (blocks.at(i).segment is not None and i + 1 < len(blocks)
               and blocks.at(i + 1).stream == stream
               and _expandable_size(blocks.at(i + 1)) < _expandable_size(blocks.at(i))):
            i += 1
        block = blocks.at(i)
        if size < self._max_split <= block.size:
            return None
        if size >= self._max_split and block.size >= size + K_LARGE_BUFFER:
            return None
        blocks.remove(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.is_small or self.config.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self._max_split and remaining > K_SMALL_SIZE

    def _alloc_block(self, pool: _Pool, size: int, stream: int) -> _Block | None:
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, size, stream)
        nbytes = segment_size(size)
        if not self._grow_reserved(nbytes):
            return None
        self._num_malloc_segments += 1
        return _Block(self._new_address(nbytes), nbytes, pool, stream)

    def _release_block(self, block: _Block) -> None:
        assert block.segment is None and not block.is_split(), "only whole cudaMalloc segments"
        block.pool.blocks.remove(block)
        self._reserved -= block.size
        self._num_malloc_segments -= 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        if self.config.max_split_size_bytes is None or self.config.expandable_segments:
            return False  # (release_block cannot free an expandable block)
        key_size, blocks = max(size, self._max_split), pool.blocks
        i = blocks.lower_bound((stream, key_size, -1))
        if i < len(blocks) and blocks.at(i).stream == stream:
            self._release_block(blocks.at(i))
            return True
        released, i = 0, i - 1  # no single block is enough: free oversize ones, largest first
        while (released < key_size and i >= 0 and blocks.at(i).stream == stream
               and blocks.at(i).size >= self._max_split):
            released += blocks.at(i).size
            self._release_block(blocks.at(i))
            i -= 1
        return released >= key_size

    def _release_cached_blocks(self) -> None:
        for pool in (self._large, self._small):
            to_unmap = []
            for block in pool.blocks:
                if block.segment is not None:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.mapped and not block.is_split():
                    pool.unmapped.remove(block)
                    self._expandable.remove(block.segment)

    def _try_merge(self, dst: _Block, src: _Block | None) -> None:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        (src.pool.blocks if src.mapped else src.pool.unmapped).remove(src)
        if dst.prev is src:
            dst.addr = src.addr
            _splice(dst, src.prev, dst.next)
        else:
            _splice(dst, dst.prev, src.next)
        dst.size += src.size


def replay(events: Iterable[tuple[Hashable, int]],
           config: AllocatorConfig = AllocatorConfig()) -> AllocatorStats:
    """Replay ``(key, delta_bytes)`` events: delta > 0 allocates a block for ``key``, delta < 0
    frees it (the magnitude is informational), delta == 0 is skipped (Note 5)."""
    allocator, handles = CachingAllocator(config), {}
    for key, delta in events:
        if delta > 0:
            if key in handles:
                raise ValueError(f"key {key!r} allocated again before it was freed")
            handles[key] = allocator.malloc(delta)
        elif delta < 0:
            if key not in handles:
                raise ValueError(f"key {key!r} freed but not allocated (or freed twice)")
            allocator.free(handles.pop(key))
    return allocator.stats
