"""Expandable segments in the caching allocator model (``expandable_segments:True``): the
part of ``allocator.CachingAllocator`` that maps and unmaps pages of one growing segment per
pool and stream (c10/cuda/CUDACachingAllocator.cpp, 2.6-2.13).

Note 1: expandable segments. One segment per (pool, stream) reserves a huge virtual range and maps
pages on demand: 2 MiB (``kSmallBuffer``) in the small pool, 20 MiB (``kLargeBuffer``, called
``large_segment_size`` in 2.13) in the large pool. Without a cached fit, the lowest-address run of
free + unmapped space that fits is mapped with just enough whole pages
(``find_expandable_block``, ``map_block``). Best fit sees a free block in front of unmapped space
as bigger (``expandable_size``), so interior holes go first. Releasing the cache unmaps whole pages
inside free blocks (``unmap_block``) and drops a segment with no page left. Hence reserved ~
allocated rounded up to pages, plus free space stuck between live blocks.
"""

from __future__ import annotations

from memfit.trace._allocator_blocks import (_ADDRESS_SPACE_BYTES, K_LARGE_BUFFER, K_SMALL_BUFFER,
                                            _Block, _Pool, _round_up, _Segment, _splice)

__all__ = ["ExpandableSegments"]


class ExpandableSegments:
    """The expandable-segments methods of ``CachingAllocator`` (Note 1), mixed into it; named
    after their C++ counterparts. They use the allocator's ``_grow_reserved``,
    ``_new_address``, ``_try_merge``, ``_reserved`` and ``_expandable`` (its segments)."""

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> _Block:
        def has_room(b: _Block | None) -> bool:
            room = 0
            while room < size and b is not None and not b.allocated:
                room, b = room + b.size, b.next
            return room >= size

        for i in range(pool.unmapped.lower_bound((stream, -1)), len(pool.unmapped)):
            c = pool.unmapped.at(i)
            if c.stream != stream:
                break
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if has_room(c):
                return c
        page = K_SMALL_BUFFER if pool.is_small else K_LARGE_BUFFER
        va_bytes = _round_up(_ADDRESS_SPACE_BYTES, page)
        segment = _Segment(self._new_address(va_bytes), page)
        self._expandable.append(segment)
        candidate = _Block(segment.base, va_bytes, pool, stream, segment, mapped=False)
        pool.unmapped.add(candidate)
        return candidate

    def _map_block(self, block: _Block, nbytes: int) -> bool:
        seg = block.segment
        assert seg is not None and (block.addr - seg.base) % seg.page_bytes == 0
        mapped = _round_up(nbytes, seg.page_bytes)
        if not self._grow_reserved(mapped):
            return False
        block.pool.unmapped.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = _Block(block.addr + mapped, block.size - mapped, block.pool, block.stream, seg,
                          mapped=False)
            _splice(rest, block, block.next)
            block.pool.unmapped.add(rest)
            block.size = mapped
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        block.pool.blocks.add(block)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int,
                                       stream: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:  # free block, then unmapped space: map and merge
            after = candidate.next
            if not self._map_block(after, min(size - candidate.size, after.size)):
                return None
            candidate = after
        pool.blocks.remove(candidate)
        return candidate

    def _unmap_block(self, block: _Block) -> None:
        seg, end = block.segment, block.addr + block.size
        first = seg.base + _round_up(block.addr - seg.base, seg.page_bytes)
        last = seg.base + (end - seg.base) // seg.page_bytes * seg.page_bytes
        if first >= last:
            return
        pool = block.pool
        pool.blocks.remove(block)
        if first > block.addr:
            before = _Block(block.addr, first - block.addr, pool, block.stream, seg)
            _splice(before, block.prev, block)
            pool.blocks.add(before)
        if last < end:
            after = _Block(last, end - last, pool, block.stream, seg)
            _splice(after, block, block.next)
            pool.blocks.add(after)
        block.addr, block.size, block.mapped = first, last - first, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.unmapped.add(block)
        self._reserved -= last - first
