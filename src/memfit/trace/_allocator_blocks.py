"""The caching allocator model's sizes and block bookkeeping (``allocator.CachingAllocator``).

Sizes are PyTorch's constants (c10/cuda/CUDACachingAllocator.cpp); blocks are the C++
``Block``s of a segment, doubly linked by address, kept free in sorted sets per pool.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest small-pool request
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segment and expandable page
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer: segment for 1-10 MiB requests, large expandable page
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
K_ROUND_LARGE = 2 * MiB  # kRoundLarge
_ADDRESS_SPACE_BYTES = 1 << 40  # virtual range of one expandable segment (not 1.125 x memory)
_UNLIMITED = 1 << 62


def round_size(nbytes: int) -> int:
    """Bytes a request of ``nbytes`` occupies in a block: rounded up to ``kMinBlockSize`` (512 B);
    0 stays 0 (a 0-byte request takes no memory)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def segment_size(nbytes: int) -> int:
    """Bytes of the segment cudaMalloc'd for a request of ``nbytes`` (``get_allocation_size``)."""
    size = round_size(nbytes)
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return _round_up(size, K_ROUND_LARGE)


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclass(eq=False)
class _Segment:
    """An expandable segment: a virtual range mapped in pages on demand (2 MiB pages in the
    small pool, 20 MiB in the large one)."""

    base: int
    page_bytes: int


@dataclass(eq=False)
class _Block:
    """Bytes ``[addr, addr + size)`` of one segment (C++ ``Block``); unmapped only if expandable."""

    addr: int
    size: int
    pool: _Pool
    stream: int
    segment: _Segment | None = None  # None: a cudaMalloc'd segment
    allocated: bool = False
    mapped: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


def _splice(block: _Block, before: _Block | None, after: _Block | None) -> None:
    block.prev, block.next = before, after
    if before is not None:
        before.next = block
    if after is not None:
        after.prev = block


class _BlockSet:
    """A sorted set of blocks (std::set with a comparator). Never mutate a member's key fields."""

    def __init__(self, key: Callable[[_Block], tuple]):
        self._key, self._keys, self._blocks = key, [], {}

    def add(self, b: _Block) -> None:
        k = self._key(b)
        bisect.insort(self._keys, k)
        self._blocks[k] = b

    def remove(self, b: _Block) -> None:
        k = self._key(b)
        del self._keys[bisect.bisect_left(self._keys, k)], self._blocks[k]

    def lower_bound(self, key: tuple) -> int:
        return bisect.bisect_left(self._keys, key)

    def at(self, i: int) -> _Block:
        return self._blocks[self._keys[i]]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self):
        return iter([self._blocks[k] for k in self._keys])


class _Pool:
    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.blocks = _BlockSet(lambda b: (b.stream, b.size, b.addr))  # free, mapped
        self.unmapped = _BlockSet(lambda b: (b.stream, b.addr))  # expandable only


def _expandable_size(b: _Block) -> int:
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)
