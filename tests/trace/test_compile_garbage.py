"""trace._compile_garbage: between a compiled trace's two steps, what Dynamo's garbage reaches
is kept alive and every other cycle of the first step is freed (the end-to-end figure, a
compiled llama's first-step KV cache, is tests/trace/test_compiled.py's)."""

import gc

import torch
from torch._dynamo.source import LocalSource
from torch._dynamo.variables.lazy import LazyCache

from memfit.trace._compile_garbage import CompileGarbage


def _storage_ref(t: torch.Tensor):
    return t.untyped_storage()._weak_ref()


def _expired(ref) -> bool:
    return torch.UntypedStorage._expired(ref)


def test_dynamo_garbage_is_kept_and_the_rest_freed():
    was = gc.isenabled()
    with CompileGarbage() as garbage:
        assert not gc.isenabled()          # no collection reaches the first step's garbage
        held, other = torch.ones(256), torch.ones(512)
        cycle = [other]
        cycle.append(cycle)                # a cycle of the step's own: freed at keep
        cache = LazyCache(held, LocalSource("x"))   # Dynamo's wrapper of what a call read
        cache.me = cache
        refs = _storage_ref(held), _storage_ref(other)
        del held, other, cycle, cache
        assert not any(_expired(r) for r in refs)      # garbage, not yet collected
        garbage.keep()
        assert gc.isenabled() == was
        assert not _expired(refs[0]) and _expired(refs[1])
        assert garbage.kept_bytes == 256 * 4
    gc.collect()
    assert _expired(refs[0])               # leaving lets what was kept go
    for r in refs:
        torch.UntypedStorage._free_weak_ref(r)
    assert gc.isenabled() == was


def test_the_collector_comes_back_on_without_keep():
    """A trace that fails in its first step leaves the collector as it found it."""
    was = gc.isenabled()
    try:
        with CompileGarbage():
            raise RuntimeError("the first step failed")
    except RuntimeError:
        pass
    assert gc.isenabled() == was and gc.get_freeze_count() == 0


def test_garbage_from_before_the_trace_is_not_its_own():
    """An earlier trace's compile left its garbage (frozen while this trace runs): not kept,
    and collected after it as before."""
    held = torch.ones(128)
    cache = LazyCache(held, LocalSource("y"))
    cache.me = cache
    ref = _storage_ref(held)
    del held, cache
    with CompileGarbage() as garbage:
        garbage.keep()
        assert garbage.kept_bytes == 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert _expired(ref)
    torch.UntypedStorage._free_weak_ref(ref)
