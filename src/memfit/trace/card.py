"""The whole card as NVML counts it: the step's device bytes, line by line, and the driver's share.

Note 1 (the lines). What a training process holds on the card (``nvidia-smi``'s per-process
figure, ``Estimate.device_bytes``) is the caching allocator's reserved bytes plus what lives
outside it: the CUDA context with the kernels the step loaded, cuDNN's kernels when a convolution
ran, NCCL's buffers under ``torch.distributed``. The reserved bytes are split into the cuBLAS /
cuBLASLt workspaces (allocated through the allocator at the first matmuls, one per handle and
stream, and handles are per thread: the calling thread's and autograd's device thread's) and the
rest. ``lines`` adds up to ``device_bytes`` exactly, by construction (a test holds it).

Note 2 (the card). The card's total as NVML reports it (``nvml_total_bytes`` where a public
nvidia-smi total is known, else ``memory_bytes``; ECC check bits are already outside NVML's
total) less what the driver keeps is the total ``cudaMemGetInfo`` reports (``usable_bytes``). ``card_used_bytes`` adds
the driver's share to the step's device bytes: what NVML's used (nvidia-smi's "Memory-Usage" on
drivers that count the driver's reservation as used) reads with the step alone on the card.
``fits`` compares ``device_bytes`` with ``usable_bytes`` (or a budget), which is the same
comparison as ``card_used_bytes`` with ``card_total_bytes``; the planner
uses the same ``device_bytes``, so there is one number for both.

Note 3 (convolutions). The trace knows whether a convolution ran (an ``aten.convolution`` or
``aten.convolution_backward`` in its op log): only then is cuDNN's figure added.

Note 4 (NCCL). memfit estimates one process (no sharding knob yet): the NCCL line is 0, kept so
that its place is visible (``memfit._cuda_overhead`` holds the measured figures of each NCCL
communicator's buffers).

Note 5 (unified memory). bitsandbytes' paged optimizers allocate their state (each moment of a
parameter of at least 100,000 values) with ``cudaMallocManaged``, outside the caching allocator.
While it fits, the driver keeps it resident on the card, so nvidia-smi counts it and so does
``device_bytes``, on its own line (``unified_memory``); the allocator's peak and breakdown leave
it out. Under pressure the driver may page it to the host at a cost per step: memfit counts it
resident and does not plan on that.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CardBreakdown", "card_breakdown", "ran_convolution", "cudnn_bytes",
           "fixed_bytes", "LINES"]

LINES = ("allocator", "cublas_workspace", "cuda_context", "library_kernels", "cudnn", "nccl",
         "unified_memory")


@dataclass(frozen=True)
class CardBreakdown:
    """A step's bytes on the card (Note 1) and the driver's share (Note 2). Bytes."""

    allocator_bytes: int         # reserved by the caching allocator, less the cuBLAS workspace
    cublas_workspace_bytes: int  # cuBLAS + cuBLASLt workspace, inside the allocator's reservation
    cuda_context_bytes: int      # driver and runtime state, torch's kernels at init
    library_kernels_bytes: int   # kernels the step's first ops loaded (cuBLAS, torch's), lazily
    cudnn_bytes: int             # cuDNN's kernels, when a convolution ran (Note 3)
    nccl_bytes: int              # NCCL buffers under torch.distributed (Note 4: 0 for now)
    driver_reserved_bytes: int   # what the driver and ECC keep of the card (Note 2)
    card_total_bytes: int        # the card's memory as NVML reports it (Note 2)
    notes: tuple[str, ...] = ()  # where the non-allocator figures come from
    unified_memory_bytes: int = 0  # paged optimizer state, resident on the card (Note 5)

    @property
    def lines(self) -> dict[str, int]:
        """Line -> bytes; adds up exactly to ``device_bytes`` (Note 1)."""
        return {"allocator": self.allocator_bytes, "cublas_workspace": self.cublas_workspace_bytes,
                "cuda_context": self.cuda_context_bytes,
                "library_kernels": self.library_kernels_bytes, "cudnn": self.cudnn_bytes,
                "nccl": self.nccl_bytes, "unified_memory": self.unified_memory_bytes}

    @property
    def reserved_bytes(self) -> int:
        return self.allocator_bytes + self.cublas_workspace_bytes

    @property
    def outside_allocator_bytes(self) -> int:
        """Bytes outside the caching allocator: ``Estimate.context_bytes``."""
        return self.cuda_context_bytes + self.library_kernels_bytes + self.cudnn_bytes + \
            self.nccl_bytes + self.unified_memory_bytes

    @property
    def device_bytes(self) -> int:
        return sum(self.lines.values())

    @property
    def card_used_bytes(self) -> int:
        """The step's bytes plus the driver's share: nvidia-smi's used with the step alone."""
        return self.device_bytes + self.driver_reserved_bytes

    def to_dict(self) -> dict:
        return {**{f"{k}_bytes": v for k, v in self.lines.items()},
                "device_bytes": self.device_bytes,
                "driver_reserved_bytes": self.driver_reserved_bytes,
                "card_used_bytes": self.card_used_bytes, "card_total_bytes": self.card_total_bytes,
                "notes": list(self.notes)}


def step_workspace_bytes(spec) -> int:
    """The workspaces a step's first matmuls and backward allocate inside the caching allocator
    on ``spec`` (cuBLAS with cuBLASLt's, autograd's); 0 off CUDA."""
    return spec.cublas_workspace_bytes + spec.autograd_workspace_bytes \
        if spec.kind == "cuda" else 0


def fixed_bytes(spec, op_log) -> tuple[int, int]:
    """(bytes inside the allocator a step always adds, bytes outside it) on ``spec``, of a step
    that ran ``op_log``: the workspaces, and the CUDA context with the kernels a step loads and
    cuDNN's where a convolution ran; (0, 0) off CUDA. What a trace without the allocator
    replayed leaves out of the card, beside the allocator's rounding."""
    if spec.kind != "cuda":
        return 0, 0
    return step_workspace_bytes(spec), spec.cuda_context_bytes + cudnn_bytes(spec, op_log)


def ran_convolution(op_log) -> bool:
    """Whether a convolution ran in the traced step (Note 3)."""
    return any(op.startswith(("aten.convolution", "aten.cudnn_convolution")) for op in op_log)


def cudnn_bytes(spec, op_log) -> int:
    """cuDNN's kernels on ``spec``'s card where a convolution ran in ``op_log`` (Note 3)."""
    return spec.cudnn_bytes if ran_convolution(op_log) else 0


def card_breakdown(spec, reserved_bytes: int, op_log, workspace_bytes: int | None = None,
                   unified_memory_bytes: int = 0) -> CardBreakdown:
    """The card lines of a step on ``spec`` that reserves ``reserved_bytes`` (Notes 1-5), of
    which ``workspace_bytes`` are cuBLAS workspaces (default: one handle's), with
    ``unified_memory_bytes`` of paged optimizer state beside the allocator."""
    assert spec.kind == "cuda", spec.name
    if workspace_bytes is None:
        workspace_bytes = spec.cublas_workspace_bytes
    workspace = min(workspace_bytes, reserved_bytes)
    cudnn = cudnn_bytes(spec, op_log)
    notes = list(spec.figure_notes)
    if cudnn:
        notes.append(f"a convolution ran: cuDNN's kernels {spec.cudnn_bytes} B added")
    if unified_memory_bytes:
        notes.append(f"paged optimizer state: {unified_memory_bytes:,} B in unified memory "
                     "(bitsandbytes' cudaMallocManaged), resident on the card beside the "
                     "allocator: in the device bytes, not in the allocated peak or its "
                     "breakdown; under memory pressure the driver may page it to the host")
    return CardBreakdown(
        allocator_bytes=reserved_bytes - workspace, cublas_workspace_bytes=workspace,
        cuda_context_bytes=spec.cuda_context_bytes - spec.library_kernels_bytes,
        library_kernels_bytes=spec.library_kernels_bytes,
        cudnn_bytes=cudnn, nccl_bytes=0,
        driver_reserved_bytes=(spec.nvml_total_bytes or spec.memory_bytes) - spec.usable_bytes,
        card_total_bytes=spec.nvml_total_bytes or spec.memory_bytes, notes=tuple(notes),
        unified_memory_bytes=unified_memory_bytes)
