"""The caching-allocator model against hand-computed sequences.

Oracle: every expected number is worked out in a comment from the C++ constants the module's
notes cite (kMinBlockSize 512 B, kSmallSize 1 MiB, kSmallBuffer 2 MiB, kLargeBuffer 20 MiB,
kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB) and the rules of CUDACachingAllocator.cpp. The last
tests check invariants on random traces (allocated <= reserved; segments add up).
"""

import random

import pytest

from memfit.trace.allocator import (
    AllocatorConfig,
    AllocatorOOM,
    CachingAllocator,
    replay,
    round_size,
    segment_size,
)

KiB, MiB = 1 << 10, 1 << 20
EXPANDABLE = AllocatorConfig(expandable_segments=True)


@pytest.mark.parametrize("nbytes, rounded, segment", [
    (1, 512, 2 * MiB),                       # up to kMinBlockSize; <= 1 MiB: kSmallBuffer
    (512, 512, 2 * MiB),
    (513, 1024, 2 * MiB),                    # next multiple of 512
    (1 * MiB, 1 * MiB, 2 * MiB),             # kSmallSize itself is still small
    (1 * MiB + 1, 1 * MiB + 512, 20 * MiB),  # large, < kMinLargeAlloc: kLargeBuffer
    (5 * MiB, 5 * MiB, 20 * MiB),
    (10 * MiB, 10 * MiB, 10 * MiB),          # not < kMinLargeAlloc: own segment, 2 MiB multiple
    (10 * MiB + 1, 10 * MiB + 512, 12 * MiB),  # rounded up to kRoundLarge
    (21 * MiB, 21 * MiB, 22 * MiB),
])
def test_round_size_and_segment_size(nbytes, rounded, segment):
    assert round_size(nbytes) == rounded
    assert segment_size(nbytes) == segment


def test_zero_bytes_use_no_memory():
    # allocate() hands out a null pointer for 0 bytes and never reaches malloc.
    alloc = CachingAllocator()
    handle = alloc.malloc(0)
    alloc.free(handle)
    s = alloc.stats
    assert (s.allocated_bytes, s.reserved_bytes, s.num_allocs, s.num_frees) == (0, 0, 0, 0)
    assert round_size(0) == 0


def test_small_pool_split_reuse_and_merge():
    alloc = CachingAllocator()
    a, b, c = (alloc.malloc(700 * KiB) for _ in range(3))
    # 700 KiB is a multiple of 512 and <= 1 MiB: small pool, 2 MiB (2048 KiB) segments.
    # a: new segment S1, split (1348 KiB left >= 512 B); b: from the 1348 KiB, 648 KiB left;
    # c: 648 < 700, so a second segment S2, 1348 KiB left.
    assert alloc.snapshot() == [[(700 * KiB, True), (700 * KiB, True), (648 * KiB, False)],
                                [(700 * KiB, True), (1348 * KiB, False)]]
    s = alloc.stats
    assert (s.allocated_bytes, s.reserved_bytes, s.num_segments) == (2100 * KiB, 4 * MiB, 2)

    alloc.free(b)  # merges with the free 648 KiB after it: 1348 KiB
    assert alloc.snapshot()[0] == [(700 * KiB, True), (1348 * KiB, False)]
    assert alloc.stats.allocated_bytes == 1400 * KiB

    # Two free 1348 KiB blocks tie on size: the lower address (S1, older) wins; 348 KiB left.
    d = alloc.malloc(1000 * KiB)
    # Best fit for 300 KiB is the 348 KiB block, not S2's 1348 KiB; 48 KiB >= 512 B is split.
    e = alloc.malloc(300 * KiB)
    assert alloc.snapshot() == [
        [(700 * KiB, True), (1000 * KiB, True), (300 * KiB, True), (48 * KiB, False)],
        [(700 * KiB, True), (1348 * KiB, False)]]
    s = alloc.stats
    # allocated 700*3 - 700 + 1000 + 300 = 2700 KiB; reserved never grew past the 2 segments.
    assert (s.allocated_bytes, s.max_allocated_bytes) == (2700 * KiB, 2700 * KiB)
    assert (s.reserved_bytes, s.max_reserved_bytes) == (4 * MiB, 4 * MiB)

    for h in (a, d, e):  # S1 merges back into one free 2 MiB block
        alloc.free(h)
    assert alloc.snapshot()[0] == [(2 * MiB, False)]
    alloc.free(c)
    assert alloc.stats.num_frees == 5


def test_large_pool_split_threshold():
    alloc = CachingAllocator()
    x = alloc.malloc(4 * MiB)    # 1 MiB < 4 MiB < 10 MiB: a 20 MiB segment, 16 MiB left (> 1 MiB)
    y = alloc.malloc(12 * MiB)   # best fit is the cached 16 MiB block, 4 MiB left (> 1 MiB): split
    assert alloc.snapshot() == [[(4 * MiB, True), (12 * MiB, True), (4 * MiB, False)]]
    assert (alloc.stats.allocated_bytes, alloc.stats.reserved_bytes) == (16 * MiB, 20 * MiB)

    # 3.5 MiB from the 4 MiB block leaves 0.5 MiB <= kSmallSize: not split, the whole block is
    # handed out and allocated counts 4 MiB: 4 + 12 + 4 = 20 MiB.
    alloc.malloc(3 * MiB + 512 * KiB)
    assert alloc.snapshot() == [[(4 * MiB, True), (12 * MiB, True), (4 * MiB, True)]]
    assert alloc.stats.allocated_bytes == 20 * MiB

    alloc.free(y)
    alloc.free(x)  # merges with y's block: 16 MiB free at the front
    assert alloc.snapshot() == [[(16 * MiB, False), (4 * MiB, True)]]
    # 15 MiB leaves exactly 1 MiB, not > kSmallSize: unsplit, allocated 16 + 4 = 20 MiB.
    alloc.malloc(15 * MiB)
    assert alloc.snapshot() == [[(16 * MiB, True), (4 * MiB, True)]]
    assert alloc.stats.allocated_bytes == 20 * MiB
    assert alloc.stats.reserved_bytes == 20 * MiB


def test_empty_cache_releases_only_wholly_free_segments():
    alloc = CachingAllocator()
    p = alloc.malloc(30 * MiB)  # own 30 MiB segment
    q = alloc.malloc(4 * MiB)   # 20 MiB segment: [4 used][16 free]
    r = alloc.malloc(2 * MiB)   # from the 16 MiB: [4][2][14 free]
    alloc.free(p)
    alloc.free(q)               # q's segment: [4 free][2 used][14 free], still split
    alloc.empty_cache()         # only p's segment is wholly free: reserved 50 -> 20 MiB
    s = alloc.stats
    assert (s.reserved_bytes, s.num_segments, s.max_reserved_bytes) == (20 * MiB, 1, 50 * MiB)
    alloc.free(r)               # merges into one free 20 MiB block
    alloc.empty_cache()
    assert (alloc.stats.reserved_bytes, alloc.stats.num_segments) == (0, 0)


def test_capacity_retry_frees_cache_then_raises():
    alloc = CachingAllocator(AllocatorConfig(capacity_bytes=64 * MiB))
    alloc.free(alloc.malloc(30 * MiB))  # leaves a cached 30 MiB segment
    alloc.malloc(40 * MiB)  # 30 + 40 = 70 > 64: release the cached 30 MiB, retry: reserved 40
    s = alloc.stats
    assert (s.reserved_bytes, s.max_reserved_bytes, s.num_alloc_retries) == (40 * MiB, 40 * MiB, 1)

    with pytest.raises(AllocatorOOM) as info:  # 40 + 30 = 70 > 64 with nothing cached
        alloc.malloc(30 * MiB)
    err = info.value
    assert isinstance(err, MemoryError)
    assert (err.requested_bytes, err.segment_bytes) == (30 * MiB, 30 * MiB)
    assert (err.allocated_bytes, err.reserved_bytes, err.capacity_bytes) == (
        40 * MiB, 40 * MiB, 64 * MiB)
    alloc.malloc(24 * MiB)  # the allocator is still usable: 40 + 24 = 64 fits exactly
    assert alloc.stats.reserved_bytes == 64 * MiB


def test_split_cached_blocks_are_not_released_on_oom():
    alloc = CachingAllocator(AllocatorConfig(capacity_bytes=32 * MiB))
    a = alloc.malloc(4 * MiB)   # 20 MiB segment: [4][16 free]
    alloc.malloc(14 * MiB)      # [4][14][2 free]
    alloc.free(a)               # [4 free][14][2 free]: 6 MiB cached but stuck in a split segment
    # 6 MiB fits no single free block; a new 20 MiB segment would make 40 > 32, and
    # release_cached_blocks cannot free a split segment.
    with pytest.raises(AllocatorOOM, match="expandable_segments"):
        alloc.malloc(6 * MiB)


def test_max_split_size_keeps_oversize_blocks_whole():
    cfg = AllocatorConfig(max_split_size_bytes=40 * MiB)
    alloc = CachingAllocator(cfg)
    alloc.free(alloc.malloc(50 * MiB))  # a cached 50 MiB block, >= max_split_size
    alloc.malloc(4 * MiB)  # 4 < 40 <= 50: may not use it; a new 20 MiB segment: 50 + 20
    assert alloc.stats.reserved_bytes == 70 * MiB
    # 45 >= 40 and 50 < 45 + 20 (kLargeBuffer): reuse the 50 MiB block unsplit.
    alloc.malloc(45 * MiB)
    assert alloc.stats.allocated_bytes == 4 * MiB + 50 * MiB
    assert alloc.stats.reserved_bytes == 70 * MiB

    # Without max_split_size the 4 MiB request splits the cached 50 MiB block instead.
    default = CachingAllocator()
    default.free(default.malloc(50 * MiB))
    default.malloc(4 * MiB)
    assert default.stats.reserved_bytes == 50 * MiB

    with pytest.raises(ValueError, match="max_split_size_bytes"):
        AllocatorConfig(max_split_size_bytes=20 * MiB)  # PyTorch requires > 20 MiB


def test_max_split_size_oom_releases_oversize_blocks_first():
    cfg = AllocatorConfig(max_split_size_bytes=30 * MiB, capacity_bytes=100 * MiB)
    alloc = CachingAllocator(cfg)
    alloc.free(alloc.malloc(40 * MiB))     # cached 40 MiB oversize block
    keep = alloc.malloc(50 * MiB)          # 40 < 50, new segment: reserved 90
    alloc.malloc(4 * MiB)  # 4 < 30 <= 40: no reuse; 90 + 20 > 100; release_available frees the
    # smallest cached block >= 30 MiB (the 40 MiB one) and the retry fits: 50 + 20 = 70 MiB.
    s = alloc.stats
    assert (s.reserved_bytes, s.num_alloc_retries) == (70 * MiB, 0)
    alloc.free(keep)


def test_expandable_segments_growing_batch():
    # The "batch N+1" pattern from Note [Expandable Segments]: each step a bit bigger.
    events = [("a", 25 * MiB), ("a", -25 * MiB), ("b", 27 * MiB), ("b", -27 * MiB),
              ("c", 29 * MiB), ("c", -29 * MiB)]
    default = replay(events)
    # Default: no cached block fits the next size, so three segments, 26 + 28 + 30 MiB
    # (rounded to kRoundLarge); each leaves 1 MiB, not > kSmallSize, so the block is the whole
    # segment and the allocated peak is 30 MiB.
    assert (default.max_reserved_bytes, default.max_allocated_bytes) == (84 * MiB, 30 * MiB)
    grown = replay(events, EXPANDABLE)
    # Expandable: 25 MiB maps two 20 MiB pages (40 MiB) and splits exactly (remainder >= 512 B);
    # 27 and 29 MiB reuse the merged 40 MiB block. Peak allocated is the exact 29 MiB.
    assert (grown.max_reserved_bytes, grown.max_allocated_bytes) == (40 * MiB, 29 * MiB)
    assert grown.max_allocated_bytes <= grown.max_reserved_bytes <= default.max_reserved_bytes
    assert grown.fragmentation_at_peak < default.fragmentation_at_peak


def test_expandable_release_unmaps_whole_pages_and_refills_lowest_address():
    alloc = CachingAllocator(EXPANDABLE)
    x = alloc.malloc(25 * MiB)   # maps [0, 40) MiB; x = [0, 25)
    alloc.malloc(10 * MiB)       # [25, 35); free [35, 40)
    alloc.free(x)                # free [0, 25)
    alloc.empty_cache()
    # Whole 20 MiB pages inside free blocks: [0, 20) only; [20, 25) and [35, 40) stay mapped.
    assert alloc.snapshot() == [[(5 * MiB, False), (10 * MiB, True), (5 * MiB, False)]]
    s = alloc.stats
    assert (s.reserved_bytes, s.allocated_bytes, s.num_segments) == (20 * MiB, 10 * MiB, 1)

    # 30 MiB: the unmapped hole [0, 20) plus free [20, 25) is only 25 MiB before the live block,
    # so the run starts at free [35, 40) and maps ceil(25 / 20) = 2 pages: [40, 80) MiB.
    alloc.malloc(30 * MiB)
    assert alloc.snapshot() == [[(5 * MiB, False), (10 * MiB, True), (30 * MiB, True),
                                 (15 * MiB, False)]]
    assert alloc.stats.reserved_bytes == 20 * MiB + 40 * MiB


def test_expandable_empty_cache_drops_an_idle_segment():
    alloc = CachingAllocator(EXPANDABLE)
    alloc.free(alloc.malloc(700 * KiB))  # small pool: one 2 MiB page
    assert alloc.stats.reserved_bytes == 2 * MiB
    alloc.empty_cache()
    assert (alloc.stats.reserved_bytes, alloc.stats.num_segments) == (0, 0)


def test_replay_rejects_unknown_free_and_double_alloc():
    with pytest.raises(ValueError, match="freed but not allocated"):
        replay([("w", -4)])
    with pytest.raises(ValueError, match="allocated again"):
        replay([("w", 4), ("w", 4)])
    with pytest.raises(ValueError, match="not live"):
        CachingAllocator().free(123)


@pytest.mark.parametrize("config", [AllocatorConfig(), EXPANDABLE,
                                    AllocatorConfig(max_split_size_bytes=64 * MiB)])
def test_random_trace_invariants(config):
    rng = random.Random(0)
    alloc, live, peak_live = CachingAllocator(config), [], 0
    for step in range(3000):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, 1 * MiB), rng.randint(1, 12 * MiB),
                               rng.randint(1, 80 * MiB)])
            live.append(alloc.malloc(size))
        if step % 500 == 499:
            alloc.empty_cache()
        s, segments = alloc.stats, alloc.snapshot()
        blocks = [b for seg in segments for b in seg]
        # Oracle: the segment layout must add up to the counters.
        assert s.allocated_bytes == sum(size for size, used in blocks if used)
        assert s.reserved_bytes == sum(size for size, _ in blocks)
        assert s.allocated_bytes <= s.reserved_bytes <= s.max_reserved_bytes
        peak_live = max(peak_live, s.allocated_bytes)
    assert alloc.stats.max_allocated_bytes == peak_live
