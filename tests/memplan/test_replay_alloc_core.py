"""The replay allocator's C++ (``memplan/_replay_alloc.cpp``) and its Python front.

Without CUDA it is not built, and memfit says so; its source ships with the package. Its matching
core compiles on the host (``-DMEMFIT_REPLAY_HOST``: malloc/free instead of cudaMalloc/cudaFree)
and, fed a real CPU step's allocation sequence (``memfit.track``) with and without injected
mismatches, counts exactly what the Python matcher (``replay_match``, the spec) counts."""

import ctypes
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import memfit
from memfit.memplan import static_plan, storage_log
from memfit.memplan.replay_allocator import (ReplayAllocator, ReplayAllocatorUnavailable,
                                             source_path, unavailable_reason)
from memfit.memplan.replay_match import ReplayMatcher
from tests.helpers import tiny, track_real_step
from tests.memplan.test_replay_match import _events

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")


@needs_no_cuda
def test_without_cuda_it_is_not_built_and_says_why():
    reason = unavailable_reason()
    assert reason == ("the replay allocator is not built: it needs CUDA and a C++ compiler "
                      "(this torch is CPU-only)")
    with pytest.raises(ReplayAllocatorUnavailable, match="this torch is CPU-only"):
        ReplayAllocator.build()


def test_the_source_ships_with_the_package():
    path = source_path()
    assert path.is_file() and path.parent.name == "memplan"
    text = path.read_text()
    for symbol in ("memfit_replay_malloc(ptrdiff_t size, int device",
                   "memfit_replay_free(void* ptr, size_t size, int device"):
        assert symbol in text            # the CUDAPluggableAllocator ABI


@pytest.mark.slow
def test_the_wheel_carries_the_source(tmp_path):
    root = source_path().parents[3]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(root)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("memfit-*.whl"))
    assert "memfit/memplan/_replay_alloc.cpp" in zipfile.ZipFile(wheel).namelist()


@pytest.mark.slow
def test_the_cuda_side_compiles_against_the_cuda_runtime(tmp_path):
    """Compiled only (no GPU to run it): the cudaMalloc / cudaFree path type-checks."""
    from torch.utils.cpp_extension import CUDA_HOME

    compiler = shutil.which("g++") or shutil.which("c++")
    homes = [h for h in (CUDA_HOME, "/usr/local/cuda") if h and
             (Path(h) / "include" / "cuda_runtime_api.h").is_file()]
    if compiler is None or not homes:
        pytest.skip("needs a C++ compiler and the CUDA toolkit's headers")
    subprocess.run([compiler, "-std=c++17", "-fPIC", "-c", f"-I{homes[0]}/include",
                    str(source_path()), "-o", str(tmp_path / "replay.o")], check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def host_core(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("replay") / "libreplay_host.so"
    subprocess.run([compiler, "-O1", "-std=c++17", "-shared", "-fPIC", "-DMEMFIT_REPLAY_HOST",
                    str(source_path()), "-o", str(out)], check=True, capture_output=True)
    return ReplayAllocator(str(out))


def _feed_cpp(core, events, sizes) -> dict:
    """Feed (is_birth, version) events; a birth mallocs ``sizes[version]`` bytes."""
    lib = core._lib
    lib.memfit_replay_malloc.restype = ctypes.c_void_p
    lib.memfit_replay_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.memfit_replay_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                       ctypes.c_void_p]
    ptrs = {}
    core.begin_step()
    for is_birth, v in events:
        if is_birth:
            ptrs[v] = lib.memfit_replay_malloc(sizes[v], 0, None)
        elif v in ptrs:
            lib.memfit_replay_free(ptrs.pop(v), sizes[v], 0, None)
    return ptrs


def _feed_py(matcher, events, sizes):
    handles = {}
    matcher.begin_step()
    for is_birth, v in events:
        if is_birth:
            handles[v], _ = matcher.malloc(sizes[v])
        elif v in handles:
            matcher.free(handles.pop(v))


@pytest.mark.slow
def test_the_cpp_core_counts_what_the_python_matcher_counts(host_core):
    model, batch = tiny("gpt2", batch_size=2, seq_len=16)
    plan = static_plan(memfit.estimate(model, batch, optimizer="adamw", device="cpu"))
    log = storage_log(track_real_step(model, batch))
    events, rank = _events(log)
    born = sorted(rank, key=rank.get)
    # an order change: two consecutive births of different sizes swap (two misses); a free
    # delayed to the step's end: its block is still held when the plan gives it again
    k = next(i for i in range(5, len(born)) if log.nbytes[born[i]] != log.nbytes[born[i + 1]])
    a, b = born[k], born[k + 1]
    late = next(v for is_birth, v in events if not is_birth)
    delayed = [e for e in events if e != (False, late)] + [(False, late)]
    cases = {"as recorded": {}, "three sizes changed": {born[3]: 4, born[40]: 4, born[41]: 4},
             "order swapped": {}, "a free delayed": {}}
    for name, change in cases.items():
        sizes = {v: int(log.nbytes[v]) + change.get(v, 0) for v in range(len(log.nbytes))}
        if name == "order swapped":
            sizes[a], sizes[b] = sizes[b], sizes[a]
        seq = delayed if name == "a free delayed" else events
        py = ReplayMatcher(plan)
        _feed_py(py, seq, sizes)
        host_core.arm(plan, device=0)
        left = _feed_cpp(host_core, seq, sizes)
        got = host_core.stats()
        want = py.stats
        assert (got.hits, got.misses, got.conflicts, got.beyond_plan) == \
            (want.hits, want.misses, want.conflicts, want.beyond_plan), name
        assert got.live_hits == len(py._live) and got.arena_bytes == plan.arena_bytes
        if name == "as recorded":
            assert want.misses == want.conflicts == want.beyond_plan == 0 and want.hits > 40
        if name == "three sizes changed":
            assert want.misses == 3
        if name == "order swapped":
            assert want.misses == 2
        if name == "a free delayed":
            assert want.conflicts >= 1 and want.misses == 0
        for v, ptr in left.items():          # the step's survivors (new gradients) go back
            host_core._lib.memfit_replay_free(ptr, sizes[v], 0, None)
        assert host_core.stats().live_hits == 0
