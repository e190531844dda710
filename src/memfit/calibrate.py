"""``memfit calibrate``: measure this machine's GPU (context, library kernels and workspaces, the
caching allocator, one real training step) and write a device profile (``memfit._device_profile``).

Note 1 (order). Each figure is a difference of device bytes used outside the caching allocator
(``cudaMemGetInfo`` total - free, less ``torch.cuda.memory_reserved``), read before and after
the first thing that loads it: CUDA's initialisation (the context), the first matmuls in each
dtype (cuBLAS/cuBLASLt kernels), the first convolution (cuDNN), a real step of a small zoo model
(the rest of the kernels it runs). So the calibration must run first in a fresh process: kernels
already loaded are not seen again. ``measure_context`` refuses to run when this process already
has a context, unless told it may (``benchmarks/gpu_check.py`` runs it first).

Note 2 (other processes). ``cudaMemGetInfo`` counts every process on the card. With NVML
(``pip install nvidia-ml-py``) the context is read as NVML's used bytes before and after
initialisation, which leaves other processes out if they hold steady; without it, the card is
taken to be this process's alone, and the profile says which way it was read.

Note 3 (the workspace). The cuBLAS/cuBLASLt workspace is what stays allocated after a matmul's
output is freed (pytorch/pytorch#95668: 8,519,680 bytes on an A10G).

Note 4 (the step). ``measure_step`` is the one routine that measures a real step, here and in
``benchmarks/gpu_check.py``: two steps, the peak statistics reset between them, then the
second's ``max_memory_allocated``, ``max_memory_reserved`` and device bytes used.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import time
from collections.abc import Callable

import torch

from memfit import __version__, zoo
from memfit._device_profile import check_profile
from memfit.api import estimate, fit
from memfit.devices import get_device
from memfit.trace.allocator import AllocatorConfig, CachingAllocator
from memfit.units import MiB

__all__ = ["require_gpu", "measure_context", "measure_libraries", "measure_allocator",
           "measure_step", "calibrate", "write_profile"]


def require_gpu() -> None:
    """ValueError, in one line, when torch sees no CUDA GPU here."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "no CUDA (a CPU-only wheel)"
        raise ValueError(f"memfit calibrate measures this machine's GPU and torch sees none here "
                         f"(torch {torch.__version__}, built for {built}): run it on the machine "
                         "with the GPU, or estimate without one with --gpu NAME (`memfit gpus`)")


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _outside() -> int:
    """Device bytes used outside the caching allocator (Note 1)."""
    torch.cuda.synchronize()
    return _used() - torch.cuda.memory_reserved()


def _nvml():
    """(handle module, device handle) when NVML is importable, else None (Note 2)."""
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()
                                                      if torch.cuda.is_initialized() else 0)


def measure_context(*, allow_initialized: bool = False) -> dict:
    """The bare CUDA context (Note 1, 2)."""
    if torch.cuda.is_initialized() and not allow_initialized:
        raise ValueError("CUDA is already initialised in this process, so its context cannot be "
                         "measured: run `memfit calibrate` in a fresh process")
    nvml = _nvml()
    before = nvml[0].nvmlDeviceGetMemoryInfo(nvml[1]).used if nvml else None
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    out = {"total_memory_bytes": torch.cuda.mem_get_info()[1]}
    if nvml:
        info = nvml[0].nvmlDeviceGetMemoryInfo(nvml[1])
        out["context_bytes"] = info.used - before - torch.cuda.memory_reserved()
        out["nvml_total_bytes"] = int(info.total)
        out["driver"] = nvml[0].nvmlSystemGetDriverVersion()
        if isinstance(out["driver"], bytes):
            out["driver"] = out["driver"].decode()
        out["context_method"] = "nvml used before and after initialisation"
    else:
        out["context_bytes"] = _outside()
        out["nvml_total_bytes"], out["driver"] = None, None
        out["context_method"] = "cudaMemGetInfo used - reserved (the card taken to be ours alone)"
    return out


def measure_libraries() -> dict:
    """cuBLAS/cuBLASLt kernels and workspace (first matmuls), cuDNN (first convolution)."""
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_bf16_supported()
                                               else [])
    start, allocated = _outside(), torch.cuda.memory_allocated()
    for dtype in dtypes:
        a = torch.randn(256, 256, device="cuda", dtype=dtype)
        (a @ a).sum().item()
        del a
    torch.cuda.synchronize()
    workspace = torch.cuda.memory_allocated() - allocated
    kernels = _outside() - start
    start = _outside()
    conv = torch.nn.Conv2d(3, 8, 3).cuda()
    conv(torch.randn(2, 3, 32, 32, device="cuda", requires_grad=True)).sum().backward()
    del conv
    gc.collect()
    return {"matmul_kernels_bytes": max(kernels, 0), "cublas_workspace_bytes": workspace,
            "cudnn_bytes": max(_outside() - start, 0)}


def measure_allocator() -> dict:
    """Reserved bytes for requests of several sizes, beside memfit's allocator model."""
    sizes = (1, 600 * 1024, 5 * MiB, 11 * MiB + 1)
    rows = []
    model = CachingAllocator(AllocatorConfig())
    for size in sizes:
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        t = torch.empty(size, dtype=torch.uint8, device="cuda")
        measured = torch.cuda.memory_reserved() - before
        del t
        handle = model.malloc(size)
        rows.append({"request_bytes": size, "reserved_bytes": measured,
                     "modelled_reserved_bytes": model.stats.reserved_bytes})
        model.free(handle)
        model = CachingAllocator(AllocatorConfig())
    torch.cuda.empty_cache()
    return {"requests": rows, "matches_model": all(r["reserved_bytes"] ==
                                                   r["modelled_reserved_bytes"] for r in rows)}


def measure_step(step: Callable[..., object], *args) -> dict:
    """One warm-up ``step(*args)``, the peak statistics reset, one more: its memory (Note 4)."""
    step(*args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    step(*args)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    used = _used()
    return {"measured_allocated_bytes": torch.cuda.max_memory_allocated(),
            "measured_reserved_bytes": torch.cuda.max_memory_reserved(),
            "measured_device_used_bytes": used,
            "measured_context_bytes": used - torch.cuda.memory_reserved(),
            "step_seconds": round(seconds, 4)}


def _zoo_step(model_name: str, batch_size: int, seq_len: int) -> dict:
    """A real step of a small zoo model beside memfit's estimate for this GPU (table figures)."""
    spec = zoo.get(model_name)
    precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    meta = spec.build(tiny=True, device="meta")
    batch_cpu = spec.make_batch(meta, batch_size, seq_len=seq_len)
    est = estimate(meta, batch_cpu, "adamw", device=get_device("cuda"), precision=precision)
    model = spec.build(tiny=True, device="cuda")
    batch = {k: v.cuda() for k, v in batch_cpu.items()}
    runner = fit(model, torch.optim.AdamW(model.parameters(), lr=1e-5), batch,
                 precision=precision)
    before = _outside()
    out = measure_step(runner.step, batch)
    out["step_kernels_bytes"] = max(out["measured_context_bytes"] - before, 0)
    out.update(model=model_name, tiny=True, batch=[batch_size, seq_len], precision=precision,
               predicted_allocated_bytes=est.peak_bytes, predicted_reserved_bytes=est.reserved_bytes,
               predicted_device_bytes=est.device_bytes)
    del runner, model, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def calibrate(*, model: str = "gpt2", batch_size: int = 8, seq_len: int = 128,
              allow_initialized: bool = False) -> dict:
    """Every measurement, as a profile (the format ``memfit._device_profile`` checks)."""
    require_gpu()
    start = time.perf_counter()
    ctx = measure_context(allow_initialized=allow_initialized)
    libs = measure_libraries()
    alloc = measure_allocator()
    step = _zoo_step(model, batch_size, seq_len)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    loading = os.environ.get("CUDA_MODULE_LOADING", "LAZY").lower()
    profile = {
        "memfit_device_profile": 1,
        "gpu": {"name": props.name, "compute_capability": [props.major, props.minor],
                "total_memory_bytes": ctx["total_memory_bytes"],
                "nvml_total_bytes": ctx["nvml_total_bytes"]},
        "driver": ctx["driver"], "cuda": torch.version.cuda, "torch": torch.__version__,
        "module_loading": "eager" if loading == "eager" else "lazy",
        "measured": {"context_bytes": ctx["context_bytes"],
                     "library_kernels_bytes": libs["matmul_kernels_bytes"]
                     + step["step_kernels_bytes"],
                     "cudnn_bytes": libs["cudnn_bytes"],
                     "cublas_workspace_bytes": libs["cublas_workspace_bytes"],
                     "context_method": ctx["context_method"], "libraries": libs,
                     "allocator": alloc, "step": step},
        "recorded": {"memfit": __version__, "seconds": round(time.perf_counter() - start, 1),
                     "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                         timespec="seconds")},
    }
    return check_profile(profile)


def write_profile(profile: dict, path: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(profile, f, indent=2)
        f.write("\n")
    return path
