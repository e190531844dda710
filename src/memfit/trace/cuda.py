"""What a CUDA GPU does differently from the CPU trace, modelled on top of it.

Note 1 (the pieces). A fake trace runs CPU kernels' meta functions. For a CUDA target:
autocast follows CUDA's op lists (``CudaAutocastMode``); SDPA runs the kernel the GPU would
pick, with that kernel's saved tensors and workspaces (``CudaSdpaMode``); bitsandbytes' 4-bit
matmul makes the dequantized weight its CUDA fallback makes (``CudaBnbMode``); a model configured
with ``flash_attention_2`` runs flash-attn 2's padded, packed (varlen) or dense kernels as
modelled in ``cuda_flash_attn`` (``FlashAttn``); optimizers take
their CUDA default, ``foreach`` (its temporaries span all parameters at once), and keep the
``step`` counter of non-capturable Adam-style optimizers in host memory; every storage goes
through a replay of the caching allocator (512-byte rounding, segments, splitting), after
the cuBLAS workspaces the first matmuls allocate (the calling thread's, and autograd's device
thread's for the backward: handles are per thread); the CUDA context is added on top.

Note 2 (two steps). The allocator's state when step 2 begins (which segments are cached and
how they are split) comes from step 1, so both steps are traced and replayed; peaks are taken
over step 2, as ``torch.cuda.reset_peak_memory_stats()`` before it would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from memfit.devices import DeviceSpec
from memfit.measure import CATEGORIES
from memfit.optimizers import impl_of
from memfit.trace.allocator import AllocatorConfig, CachingAllocator
from memfit.trace.cuda_autocast import CudaAutocastMode
from memfit.trace.cuda_bnb import CudaBnbMode
from memfit.trace.cuda_flash_attn import FlashAttn
from memfit.trace.cuda_sdpa import CudaSdpaMode

__all__ = ["CudaModel", "CudaMemory"]

_CUBLAS = "cublas-workspace"
_CUBLAS_AUTOGRAD = "cublas-workspace-autograd-thread"


@dataclass(frozen=True)
class CudaMemory:
    """The step's memory as the caching allocator would report it. Bytes."""

    allocated_peak_bytes: int     # max_memory_allocated over step 2 (rounded blocks)
    reserved_peak_bytes: int      # max_memory_reserved over step 2
    breakdown: dict[str, int]     # category -> bytes at the allocated peak ("other" holds the
                                  # cuBLAS workspace and rounding)
    peak_event: int               # ledger event at the allocated peak
    context_bytes: int            # CUDA context, outside the allocator (Note 1)
    workspace_bytes: int = 0      # the cuBLAS / cuBLASLt workspaces inside the allocator


class CudaModel:
    """The CUDA side of one traced step (Note 1)."""

    def __init__(self, spec: DeviceSpec, allocator: AllocatorConfig | None = None):
        if spec.kind != "cuda":
            raise ValueError(f"CudaModel needs a GPU, got {spec.name}")
        self.spec = spec
        self.allocator = allocator or AllocatorConfig()
        self.sdpa_calls: list[str] = []
        self.bnb_note: str | None = None       # bitsandbytes' 4-bit matmuls (cuda_bnb)
        self.flash_note: str | None = None     # flash_attention_2's calls (cuda_flash_attn)

    def autocast(self, dtype: torch.dtype):
        return CudaAutocastMode(dtype)

    @contextlib.contextmanager
    def kernels(self):
        """Active around the whole traced step: SDPA, flash-attn 2 and bitsandbytes' 4-bit
        matmul as the GPU would run them."""
        mode, bnb = CudaSdpaMode(self.spec.compute_capability), CudaBnbMode()
        flash = FlashAttn(self.spec.compute_capability, self.spec.display_name)
        with mode, bnb, flash:
            yield
        self.sdpa_calls = list(mode.calls)          # the last (steady-state) step's calls
        self.bnb_note = bnb.note()
        self.flash_note = flash.note()

    @contextlib.contextmanager
    def recompute(self, dtype: torch.dtype | None):
        """Around a checkpoint's recompute. It runs in backward, where torch-function modes
        entered around the step are no longer active, so the modelled kernels and autocast
        are entered again (checkpoint's ``recompute_context`` calls this)."""
        with CudaSdpaMode(self.spec.compute_capability), CudaBnbMode():
            with CudaAutocastMode(dtype) if dtype is not None else contextlib.nullcontext():
                yield

    @staticmethod
    def use_foreach(optimizer) -> None:
        """CUDA's default for torch optimizers: ``foreach`` unless the user chose otherwise.
        (An offloaded optimizer steps on the host, where the default is per-tensor.)"""
        if hasattr(optimizer, "host_tensors"):
            return
        per_parameter = getattr(optimizer, "optimizers", None)   # stepped in backward: each
        if isinstance(per_parameter, dict):                       # parameter's own optimizer
            for one in per_parameter.values():
                CudaModel.use_foreach(one)
            return
        inner = getattr(optimizer, "inner", optimizer)
        if hasattr(inner, "use_cuda_kernel"):    # bitsandbytes' fused kernel, which allocates
            inner.use_cuda_kernel()              # nothing (techniques._bnb_optimizer)
            return
        for group in inner.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True

    @staticmethod
    def optimizer_impl(optimizer) -> str:
        """In words, the implementation the modelled optimizer step runs (after
        ``use_foreach``): "foreach", "fused", "for-loop", or where it steps."""
        if hasattr(optimizer, "host_tensors"):
            return "stepped on the host (for-loop)"
        return impl_of(optimizer, cuda=True) or type(optimizer).__name__

    @staticmethod
    def host_tensors(optimizer) -> list[torch.Tensor]:
        """Optimizer state CUDA keeps on the host: 0-d ``step`` counters unless capturable or
        fused (``torch.optim.Adam._init_group``)."""
        inner = getattr(optimizer, "inner", optimizer)
        on_device = {id(p) for g in inner.param_groups if g.get("capturable") or g.get("fused")
                     for p in g["params"]}
        out = []
        for p, state in inner.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor) and step.dim() == 0 and id(p) not in on_device:
                out.append(step)
        return out

    @staticmethod
    def unified_tensors(optimizer) -> list[torch.Tensor]:
        """Optimizer state a GPU keeps in unified memory, off the caching allocator: the paged
        state a bitsandbytes optimizer made for this target (``paged_state``; docs/measurement.md,
        "Paged optimizer state"). None for an optimizer stepping on the host."""
        if hasattr(optimizer, "host_tensors"):
            return []
        return list(getattr(getattr(optimizer, "inner", optimizer), "paged_state", ()))

    @classmethod
    def unified_bytes(cls, optimizer) -> int:
        """The bytes of ``unified_tensors``, each storage once."""
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for t in cls.unified_tensors(optimizer)}
        return sum(storages.values())

    def replay(self, tracker) -> CudaMemory:
        """Replay the ledger through the caching allocator (Note 2)."""
        resolved = tracker.resolved
        alloc_peak, reserved_peak, peak_event, workspace = self.replay_peaks(tracker)
        exact = resolved.breakdown_at(peak_event)
        exact["other"] += alloc_peak - sum(exact.values())
        assert list(exact) == list(CATEGORIES)
        return CudaMemory(alloc_peak, reserved_peak, exact, peak_event, self.spec.cuda_context_bytes,
                          workspace)

    def replay_peaks(self, tracker, value=None) -> tuple[int, int, int, int]:
        """(allocated peak, reserved peak, ledger event at the allocated peak, workspace bytes)
        of step 2 through the caching allocator; ``value``: the ledger's sizes in another
        shape of a shared trace (``Ledger.device_events``: each size's symbolic expression)."""
        shift = tracker.ledger.first.length   # a first step made, not traced: its events
                                              # come before the log's (trace.first_step)
        window = tracker.resolved.window_start + shift
        allocator, handles, sizes = CachingAllocator(self.allocator), {}, {}
        alloc_peak, reserved_peak, peak_event = -1, 0, window - 1
        workspaces = {_CUBLAS: self.spec.cublas_workspace_bytes,      # kept from the 1st matmul
                      _CUBLAS_AUTOGRAD: self.spec.autograd_workspace_bytes}
        workspace_done = False
        for ev, sid, delta, is_resize in tracker.ledger.device_events(value):
            if ev >= 0 and not workspace_done:   # the first matmuls allocate cuBLAS's workspaces
                for key, size in workspaces.items():
                    handles[key] = allocator.malloc(size)
                workspace_done = True
            if is_resize:                        # a new block of the new size
                allocator.free(handles.pop(sid))
                sizes[sid] += delta
                handles[sid] = allocator.malloc(sizes[sid])
            elif delta > 0:
                sizes[sid] = delta
                handles[sid] = allocator.malloc(delta)
            elif sid in handles:
                allocator.free(handles.pop(sid))
            if ev >= window:
                if allocator.allocated_bytes > alloc_peak:
                    alloc_peak, peak_event = allocator.allocated_bytes, ev
                reserved_peak = max(reserved_peak, allocator.reserved_bytes)
        if not workspace_done:
            for key, size in workspaces.items():
                handles[key] = allocator.malloc(size)
        if alloc_peak < 0:
            stats = allocator.stats
            alloc_peak, reserved_peak = stats.allocated_bytes, stats.reserved_bytes
        return alloc_peak, reserved_peak, peak_event - shift, sum(workspaces.values())
