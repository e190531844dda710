"""Device memory a CUDA training process holds outside PyTorch's caching allocator, from public
measurements: the CUDA context, the library kernels a step loads, cuDNN, NCCL.

Note 1 (what the context is). The first CUDA call creates a context: driver state plus the device
code of the modules loaded. Before CUDA 11.7 every kernel of every linked library was loaded at
once (over 1000 MB for PyTorch); since 11.7, with ``CUDA_MODULE_LOADING=LAZY`` (PyTorch sets it
when unset, from 1.13: pytorch/pytorch#86509), kernels load the first time they run, so a bare
context is a few hundred MiB and grows as a step first runs its kernels (cuBLAS/cuBLASLt GEMMs,
PyTorch's elementwise, reduction and optimizer kernels). None of it shows in
``torch.cuda.memory_reserved``; all of it shows in ``nvidia-smi``. The cuBLAS/cuBLASLt
*workspaces* are not here: PyTorch allocates them through the caching allocator (one per
handle and stream; a training step runs on one stream, and autograd's backward thread has a
handle of its own), so they are inside reserved bytes (``DeviceSpec.cublas_workspace_bytes``).

Note 2 (the figures). Each figure is one public measurement, named with its URL in ``source``.
``context_figure`` picks the one measured on the same architecture and CUDA major version under
the same loading mode; where none was published it takes the largest figure measured on another
architecture under the same CUDA major and mode (the cautious side), else the generic one of that
mode (pytorch/pytorch#86509), and says so (``exact=False``), which the estimate's notes repeat. A device profile measured by
``memfit calibrate`` on the user's own card replaces all of them (``memfit.calibrate``).

Note 3 (the kernels a step loads, lazily). One public record gives the whole non-allocator
overhead after a training step: about 620 MiB above ``max_memory_reserved`` on an A10G (sm_86)
under CUDA 12, in a 2024 CI run (cited by memfit issue 13; the run's URL was not located). Less
the 256 MiB bare context measured on the same chip (GA102) under CUDA 12 (InvokeAI#9413), a
step's lazily loaded kernels take about 364 MiB. That figure is used for every GPU under lazy
loading (no per-architecture measurement was found); under eager loading it is 0 (the kernels
are in the context from the start).

Note 4 (cuDNN). A step that runs a convolution loads cuDNN: about 750 MB under eager loading
(a PyTorch forum answer, pre-lazy era). No measurement under lazy loading was found: the eager
figure is scaled by the lazy/eager ratio of the bare context measured side by side in
pytorch/pytorch#86509 (253.75 / 615.75 MiB), about 309 MB. Its workspace, like cuBLAS's, goes
through the caching allocator (cuDNN's convolutions ask PyTorch for it) and is not modelled here.

Note 5 (NCCL). Under ``torch.distributed`` each NCCL communicator holds buffers outside the
allocator: 544 MiB per 2-rank group and 688 MiB per larger group, measured on 4x A100 with NVLink
(NVIDIA/nccl#964). memfit's estimate has no sharding knob yet, so the NCCL term is 0 today; it
is in the breakdown so that the number appears where it will go.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.units import MiB

__all__ = ["Figure", "context_figure", "step_kernels_figure", "cudnn_figure", "nccl_figure",
           "lazy_loading", "parse_cuda_version", "ASSUMED_CUDA_VERSION", "MIN_CUDA", "MAX_CUDA"]


@dataclass(frozen=True)
class Figure:
    """One modelled quantity: its bytes, where it comes from, and whether that source measured
    exactly this case (``exact``) or stands in for it (Note 2)."""

    bytes: int
    source: str          # "what was measured, on what: URL"
    exact: bool = True


# The CUDA a CPU-only torch wheel assumes: what the default PyTorch wheels are built with.
ASSUMED_CUDA_VERSION = (12, 8)

_86509 = "https://github.com/pytorch/pytorch/pull/86509"
_55277 = "https://github.com/pytorch/pytorch/issues/55277"

# (architecture, CUDA major, lazy) -> bare context (Note 2). Each from one public measurement.
_CONTEXT = {
    ("ampere", 12, True): Figure(256 * MiB, "bare context, 2x RTX 3090 (GA102), torch 2.7.1+cu128, "
                                 "nvidia-smi per process: https://github.com/invoke-ai/InvokeAI/"
                                 "issues/9413"),
    ("ada", 13, True): Figure(426 * MiB, "bare context after torch.cuda.mem_get_info, RTX 6000 Ada, "
                              "torch 2.10.0+cu130, nvidia-smi: https://github.com/unslothai/"
                              "unsloth-zoo/pull/1053"),
    ("pascal", 10, False): Figure(719 * MiB, "721 MiB less a 2 MiB segment after a 1-element "
                                  f"tensor, GTX 1080, torch 1.8.2+cu101 (eager): {_55277}"),
    ("ampere", 11, False): Figure(1685 * MiB, "1687 MiB less a 2 MiB segment after a 1-element "
                                  f"tensor, RTX 3090, torch 1.8.2+cu111 (eager): {_55277}"),
    ("volta", 11, False): Figure(1341 * MiB, "'GPU memory occupied: 1343 MB' (pynvml used // "
                                 "2**20) after torch.ones((1, 1)).to('cuda') less its 2 MiB "
                                 "segment, Tesla V100-SXM2-16GB, driver 460.91.03, CUDA 11.2 "
                                 "(eager): https://huggingface.co/docs/transformers/v4.21.0/"
                                 "perf_train_gpu_one"),
    ("volta", 10, False): Figure(1005 * MiB, "1008 MiB after a small tensor less 1 MiB before and "
                                 "a 2 MiB segment, Titan V, torch 1.3 (eager): "
                                 "https://github.com/pytorch/pytorch/issues/28394"),
}
# Any architecture, by loading mode, where the table has no entry (Note 2): cudaMemGetInfo
# total - free after one randn tensor (its 20 MiB segment taken off), torch 1.13, CUDA 11.7+.
_GENERIC = {
    True: Figure(287_047_680 - 20 * MiB, f"bare context (lazy), one tensor, torch 1.13: {_86509}",
                 exact=False),
    False: Figure(666_632_192 - 20 * MiB, "bare context (CUDA_MODULE_LOADING=EAGER), one tensor, "
                  f"torch 1.13: {_86509}", exact=False),
}
_STEP_KERNELS = Figure(
    620 * MiB - 256 * MiB, "620 MiB above reserved after a step on an A10G under CUDA 12 (memfit "
    "issue 13's record, run URL not located) less the 256 MiB bare GA102 context of "
    "https://github.com/invoke-ai/InvokeAI/issues/9413 (Note 3)", exact=False)
_CUDNN_EAGER_BYTES = 750_000_000
_CUDNN = {
    False: Figure(_CUDNN_EAGER_BYTES, "cuDNN's kernels, about 750 MB (eager loading): "
                  "https://discuss.pytorch.org/t/how-pytorch-consumes-gpu/74776"),
    True: Figure(_CUDNN_EAGER_BYTES * (287_047_680 - 20 * MiB) // (666_632_192 - 20 * MiB),
                 "the eager cuDNN figure (discuss.pytorch.org/t/how-pytorch-consumes-gpu/74776) "
                 f"scaled by the lazy/eager context ratio of {_86509} (Note 4)", exact=False),
}
_NCCL = {2: Figure(544 * MiB, "per 2-rank communicator, 4x A100 NVLink: "
                   "https://github.com/NVIDIA/nccl/issues/964"),
         3: Figure(688 * MiB, "per communicator of 3+ ranks, 4x A100 NVLink: "
                   "https://github.com/NVIDIA/nccl/issues/964")}

# CUDA versions that build for each architecture: sm_60-sm_72 were dropped in CUDA 13; sm_86 came
# with 11.1, sm_89 and sm_90 with 11.8, sm_100 and sm_120 with 12.8 (CUDA release notes).
MIN_CUDA = {"pascal": (8, 0), "volta": (9, 0), "turing": (10, 0), "ampere": (11, 0),
            "ada": (11, 8), "hopper": (11, 8), "blackwell": (12, 8)}
MAX_CUDA = {"pascal": (12, 9), "volta": (12, 9)}


def parse_cuda_version(text) -> tuple[int, int]:
    """"12", "12.4", "11.8" (or (12, 4)) -> (major, minor). A bare major takes the last minor
    PyTorch ships for it (11 -> 11.8, 12 -> 12.8; 13 -> 13.0). ValueError names the fix."""
    if isinstance(text, tuple) and len(text) == 2 and all(isinstance(v, int) for v in text):
        major, minor = text
    else:
        parts = str(text).strip().split(".")
        if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"CUDA version {text!r} is not a version: give it as 12, 12.4 or "
                             "11.8 (what torch.version.cuda prints)")
        major = int(parts[0])
        minor = int(parts[1]) if len(parts) > 1 else {11: 8, 12: 8}.get(major, 0)
    if not 8 <= major <= 13:
        raise ValueError(f"CUDA version {text!r}: memfit knows CUDA 8 to 13; give one of those, "
                         "e.g. 12.4")
    return major, minor


def lazy_loading(cuda: tuple[int, int], module_loading: str) -> bool:
    """Whether kernels load lazily (Note 1): CUDA 11.7 or later and ``module_loading`` 'lazy'."""
    return cuda >= (11, 7) and module_loading == "lazy"


def context_figure(architecture: str, cuda: tuple[int, int], module_loading: str) -> Figure:
    """The bare context for ``architecture`` under ``cuda`` and the loading mode (Note 2)."""
    lazy = lazy_loading(cuda, module_loading)
    if (architecture, cuda[0], lazy) in _CONTEXT:
        return _CONTEXT[architecture, cuda[0], lazy]
    same = [f for (_, major, mode), f in _CONTEXT.items() if major == cuda[0] and mode == lazy]
    if same:
        f = max(same, key=lambda f: f.bytes)
        return Figure(f.bytes, f"measured on another architecture: {f.source}", exact=False)
    return _GENERIC[lazy]


def step_kernels_figure(cuda: tuple[int, int], module_loading: str) -> Figure:
    """Kernels a training step loads after the context exists (Note 3): 0 under eager loading."""
    if not lazy_loading(cuda, module_loading):
        return Figure(0, "eager loading: every kernel is in the context from the start")
    return _STEP_KERNELS


def cudnn_figure(cuda: tuple[int, int], module_loading: str) -> Figure:
    """cuDNN's kernels, loaded when a convolution runs (Note 4)."""
    return _CUDNN[lazy_loading(cuda, module_loading)]


def nccl_figure(ranks: int) -> Figure:
    """NCCL buffers of one communicator over ``ranks`` ranks (Note 5); 0 for a single process."""
    if ranks <= 1:
        return Figure(0, "one process: no NCCL communicator")
    return _NCCL[2 if ranks == 2 else 3]
