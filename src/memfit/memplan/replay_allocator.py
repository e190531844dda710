"""A replay allocator for CUDA: a step's allocations served at a static plan's offsets.

Note 1 (what it is). ``_replay_alloc.cpp`` (shipped beside this file) implements the
``CUDAPluggableAllocator`` malloc/free ABI over one ``cudaMalloc``'d arena of
``StaticPlan.arena_bytes``: the k-th allocation of a step gets the plan's k-th born storage's
offset when its size matches and that block is free, else ``cudaMalloc`` serves it and a miss
is counted. Its matching is ``replay_match.ReplayMatcher``'s (Note 3 there), which is tested on
CPU runs; the C++ core is compiled on the host in a slow test and held to it.

Note 2 (why the whole allocator). A ``MemPool(allocator=...)`` asks its allocator for
*segments* (the caching allocator rounds, splits and caches inside them), so a plan of storages
cannot be matched there; and the caching allocator refuses a custom-allocator pool under
``expandable_segments``. The replay allocator therefore replaces the current allocator
(``torch.cuda.memory.change_current_allocator``), which PyTorch allows only before the caching
allocator has served anything: ``ReplayAllocator.install()`` must run before the first CUDA
tensor, in a process of its own (benchmarks/gpu_check.py runs it in a subprocess). Until
``arm(plan)`` every allocation goes to ``cudaMalloc`` uncounted; ``begin_step()`` before each
step's zero_grad restarts the plan's order. Freed fallback blocks go back with ``cudaFree``
(no caching): the misses are meant to be few and counted, not fast.

Note 3 (where it cannot be built). It needs a CUDA build of torch with a GPU
(``torch.cuda.is_available()``), a C++ compiler and the CUDA runtime headers
(``torch.utils.cpp_extension``, built once into torch's extension cache at first use).
Elsewhere ``ReplayAllocator.build()`` raises ``ReplayAllocatorUnavailable`` saying which one
is missing (on this project's CPU machines: "this torch is CPU-only").
"""

from __future__ import annotations

import ctypes
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from memfit.memplan.replay_match import expected_allocations

__all__ = ["ReplayAllocator", "ReplayAllocatorUnavailable", "ReplayStats", "source_path",
           "unavailable_reason"]

_NAME = "memfit_replay_alloc"
_MALLOC, _FREE = "memfit_replay_malloc", "memfit_replay_free"


class ReplayAllocatorUnavailable(RuntimeError):
    """The replay allocator cannot be built or installed here (Note 3)."""


@dataclass(frozen=True)
class ReplayStats:
    hits: int
    misses: int              # a size other than the plan's next storage
    conflicts: int           # the planned block still held
    beyond_plan: int         # allocations past the plan's last
    live_hits: int           # blocks of the arena in use now
    arena_bytes: int


def source_path() -> Path:
    """The C++ source, as installed with the package."""
    return Path(str(resources.files("memfit.memplan").joinpath("_replay_alloc.cpp")))


def unavailable_reason() -> str | None:
    """Why the replay allocator cannot be built here, or None if it can (Note 3)."""
    if not torch.cuda.is_available():
        kind = "this torch is CPU-only" if torch.version.cuda is None else \
            "this torch has CUDA but no GPU is visible"
        return f"the replay allocator is not built: it needs CUDA and a C++ compiler ({kind})"
    from torch.utils.cpp_extension import CUDA_HOME
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "the replay allocator is not built: it needs a C++ compiler (none on PATH)"
    if CUDA_HOME is None:
        return ("the replay allocator is not built: the CUDA runtime headers were not found "
                "(set CUDA_HOME to the CUDA toolkit)")
    if not source_path().is_file():
        return f"the replay allocator's source is missing from the install: {source_path()}"
    return None


class ReplayAllocator:
    """The built library: install it as the CUDA allocator, arm it with a plan, read stats."""

    def __init__(self, library_path: str):
        self.path = library_path
        self._lib = ctypes.CDLL(library_path)
        self._lib.memfit_replay_set_plan.restype = ctypes.c_int
        self._lib.memfit_replay_set_plan.argtypes = [
            ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        self._lib.memfit_replay_arm.argtypes = [ctypes.c_int]
        self._lib.memfit_replay_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]

    @classmethod
    def build(cls, verbose: bool = False) -> "ReplayAllocator":
        """Compile ``_replay_alloc.cpp`` (once; torch's extension cache keeps it) and load it."""
        reason = unavailable_reason()
        if reason is not None:
            raise ReplayAllocatorUnavailable(reason)
        from torch.utils.cpp_extension import load

        path = load(_NAME, [str(source_path())], with_cuda=True, is_python_module=False,
                    extra_ldflags=["-lcudart"], verbose=verbose)
        return cls(path)

    def install(self) -> None:
        """Make it the process's CUDA allocator (before any CUDA tensor: Note 2)."""
        if torch.cuda.is_initialized():
            raise ReplayAllocatorUnavailable(
                "the replay allocator must be installed before the first CUDA tensor (PyTorch "
                "swaps the allocator only before it has served anything): install it at the "
                "start of a fresh process, before moving the model to the GPU")
        alloc = torch.cuda.memory.CUDAPluggableAllocator(self.path, _MALLOC, _FREE)
        torch.cuda.memory.change_current_allocator(alloc)

    def arm(self, plan, device: int = 0) -> None:
        """Serve the following steps from ``plan`` (a ``StaticPlan`` of this step, on a GPU)."""
        self.arm_expected(expected_allocations(plan), plan.arena_bytes, plan.align_bytes, device)

    def arm_expected(self, expected: list[tuple[int, int]], arena_bytes: int, align_bytes: int,
                     device: int = 0) -> None:
        """``arm`` from a plan's ``expected_allocations`` (e.g. sent to another process)."""
        sizes = (ctypes.c_int64 * len(expected))(*[int(s) for s, _ in expected])
        offsets = (ctypes.c_int64 * len(expected))(*[int(o) for _, o in expected])
        rc = self._lib.memfit_replay_set_plan(sizes, offsets, len(expected), int(arena_bytes),
                                              int(align_bytes), device)
        if rc == 1:
            raise torch.OutOfMemoryError(f"the replay allocator's arena of {arena_bytes} "
                                         "bytes could not be allocated")
        if rc == 2:
            raise RuntimeError("the replay allocator still serves blocks of its last plan: "
                               "free them (end the step) before arming another")

    def disarm(self) -> None:
        self._lib.memfit_replay_arm(0)

    def begin_step(self) -> None:
        """The next allocation is the plan's first (call before each step's zero_grad)."""
        self._lib.memfit_replay_begin_step()

    def stats(self) -> ReplayStats:
        out = (ctypes.c_int64 * 6)()
        self._lib.memfit_replay_stats(out)
        return ReplayStats(*[int(v) for v in out])
