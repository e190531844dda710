"""A GPU's figures of memory that torch does not report as tensors (the CUDA context, the
kernels a step loads, cuDNN) and of the cuBLAS workspaces, for a CUDA version and a module
loading mode: what ``with_cuda`` sets on a ``DeviceSpec`` (``memfit.devices``). The figures
themselves, each from a public measurement, are ``memfit._cuda_overhead``'s.

Note 1: memory torch does not report as tensors. The CUDA context (driver state plus the
kernels loaded; with lazy module loading, the default since CUDA 11.7 and torch 1.13, kernels
load as a step first runs them) is device memory that ``torch.cuda.memory_allocated`` never
sees: ``cuda_context_bytes`` is the context as a training step leaves it, of which
``library_kernels_bytes`` are the kernels the step loaded; ``cudnn_bytes`` is what cuDNN adds
when a convolution runs. Their figures, each from a public measurement, depend on the
architecture, the CUDA version and the loading mode (``memfit._cuda_overhead`` gives each with
its source); a profile measured on the user's card replaces them (``DeviceSpec.load``, ``memfit calibrate``).
The cuBLAS workspace *is* allocated through the caching allocator, at the first matmul, and
kept: PyTorch's default ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8`` (32 MiB) on sm90 and later and
``:4096:2:16:8`` (8 MiB + 128 KiB) before, plus a 1 MiB cuBLASLt workspace
(``CUBLASLT_WORKSPACE_SIZE``); see ``getChosenWorkspaceSize`` in
aten/src/ATen/cuda/CublasHandlePool.cpp. On an A10G (sm_86) the 8 MiB + 128 KiB is measured:
8,519,680 bytes left allocated after one ``nn.Linear`` (pytorch/pytorch#95668). The workspace
is one per cuBLAS handle and stream, and handles are per thread (a ``thread_local`` pool window
in ``getCurrentCUDABlasHandle``): the backward of CUDA tensors runs on autograd's device thread,
so its matmuls allocate a second cuBLAS workspace (``autograd_workspace_bytes``; its cuBLASLt
one only where a backward matmul takes the Lt path with an epilogue, which plain ``mm`` does
not). A public script's ``max_memory_allocated`` shows both to the byte
(benchmarks/public_records.json, efficientpytorch-sgd-accumulation-2: the one unmodelled 8 MiB +
128 KiB before this).

Note 2: the CUDA version. ``cuda_version`` is the CUDA the figures assume: what the installed
torch was built for (``torch.version.cuda``); a CPU-only wheel has none, and then
``ASSUMED_CUDA_VERSION`` (12.8, the default wheels') is taken and said in ``figure_notes``,
which every estimate repeats. ``with_cuda`` / ``get_device(..., cuda_version=)`` choose
another; an architecture that a CUDA release does not build for is refused (Blackwell needs
12.8, CUDA 13 drops Pascal and Volta).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from memfit._cuda_overhead import (ASSUMED_CUDA_VERSION, MAX_CUDA, MIN_CUDA, context_figure,
                                   cudnn_figure, lazy_loading, parse_cuda_version,
                                   step_kernels_figure)
from memfit._versions import torch_build
from memfit.units import MiB

if TYPE_CHECKING:
    from memfit._device_table import DeviceSpec

__all__ = ["CUBLASLT_WORKSPACE_BYTES", "cublas_workspace_bytes_for", "with_cuda"]

CUBLASLT_WORKSPACE_BYTES = 1024 * 1024   # CUBLASLT_WORKSPACE_SIZE's default, 1024 KiB (Note 1)


def cublas_workspace_bytes_for(cc: tuple[int, int]) -> int:
    """Note 1: cuBLAS' default workspace by compute capability, plus cuBLASLt's 1 MiB."""
    cublas = 4096 * 1024 * 8 if cc[0] >= 9 else (4096 * 2 + 16 * 8) * 1024
    return cublas + CUBLASLT_WORKSPACE_BYTES


def _default_cuda() -> tuple[tuple[int, int], str | None]:
    """The CUDA the installed torch was built for, and a note when it is assumed (Note 2);
    read without importing torch (``memfit._versions``)."""
    torch = torch_build()
    if torch.cuda:
        return parse_cuda_version(torch.cuda), None
    major, minor = ASSUMED_CUDA_VERSION
    return ASSUMED_CUDA_VERSION, (f"this torch ({torch.version}) has no CUDA: the figures "
                                  f"assume CUDA {major}.{minor}; pass --cuda-version / "
                                  "cuda_version= for yours")


def with_cuda(spec: DeviceSpec, cuda_version=None, module_loading: str | None = None) -> DeviceSpec:
    """``spec`` with its non-allocator figures (context, kernels, cuDNN) for ``cuda_version``
    ("12", "12.4", (12, 4); default: torch's, Note 2) and ``module_loading`` ("lazy" or
    "eager", what ``CUDA_MODULE_LOADING`` says; default: the spec's, "lazy" for table entries,
    torch's default since 1.13). The API reads no environment variable; the CLI's
    ``--module-loading`` defaults to the shell's ``CUDA_MODULE_LOADING``."""
    if spec.kind != "cuda":
        if cuda_version is not None:
            raise ValueError(f"cuda_version={cuda_version!r} is for a GPU; {spec.name} is not one")
        return spec
    if spec.profile_path is not None:
        if cuda_version is not None and parse_cuda_version(cuda_version)[0] != spec.cuda_version[0]:
            raise ValueError(f"the device profile {spec.profile_path} was measured under CUDA "
                             f"{spec.cuda_version[0]}.{spec.cuda_version[1]}: measure another with "
                             "`memfit calibrate` under the CUDA you want, or drop --cuda-version")
        return spec
    notes = []
    if cuda_version is None:
        cuda, assumed = _default_cuda()
        notes += [assumed] if assumed else []
    else:
        cuda = parse_cuda_version(cuda_version)
    low, high = MIN_CUDA.get(spec.architecture), MAX_CUDA.get(spec.architecture)
    if low and cuda < low or high and cuda > high:
        span = f"{low[0]}.{low[1]}" + (f" to {high[0]}.{high[1]}" if high else " or later")
        raise ValueError(f"the {spec.display_name} ({spec.architecture}, sm_"
                         f"{spec.compute_capability[0]}{spec.compute_capability[1]}) runs under "
                         f"CUDA {span}, not {cuda[0]}.{cuda[1]}: give a --cuda-version in that "
                         "range")
    module_loading = module_loading or spec.module_loading
    if module_loading not in ("lazy", "eager"):
        raise ValueError(f"module_loading must be 'lazy' or 'eager' (CUDA_MODULE_LOADING), "
                         f"got {module_loading!r}")
    context = context_figure(spec.architecture, cuda, module_loading)
    kernels = step_kernels_figure(cuda, module_loading)
    cudnn = cudnn_figure(cuda, module_loading)
    mode = "lazy" if lazy_loading(cuda, module_loading) else "eager"
    notes.append(f"CUDA {cuda[0]}.{cuda[1]}, {mode} module loading: context "
                 f"{context.bytes / MiB:.0f} MiB ({'' if context.exact else 'no measurement for '}"
                 f"{'' if context.exact else spec.architecture + ' here; '}{context.source})"
                 + (f" + {kernels.bytes / MiB:.0f} MiB of kernels a step loads ({kernels.source})"
                    if kernels.bytes else ""))
    return replace(spec, cuda_version=cuda, module_loading=module_loading,
                   cuda_context_bytes=context.bytes + kernels.bytes,
                   library_kernels_bytes=kernels.bytes, cudnn_bytes=cudnn.bytes,
                   figure_notes=tuple(notes))
