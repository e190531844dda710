"""What a device offers a training step: memory (total and usable), peak throughput, bandwidths.

``get_device("1080ti")`` returns the :class:`DeviceSpec` of a GTX 1080 Ti from the table
:data:`GPUS`; ``get_device("cuda")`` describes the GPU in this machine; ``get_device("cpu")`` the host.

Note 1: memory as sold vs usable. ``memory_bytes`` is the card's memory as NVIDIA sells it,
read in binary units ("11 GB" on a 1080 Ti is 11 GiB; "141 GB" on an H200 is 141 GiB, since CUDA
itself reports 143,156 MiB there, more than 141e9 bytes). ``usable_bytes`` is the total that
``cudaMemGetInfo`` / ``torch.cuda.get_device_properties(i).total_memory`` reports: memory_bytes less
what the driver keeps (and, on GDDR cards with ECC on, 1/16 of the memory for check bits). Figures are
the ``total_memory`` torch prints (``total_memory=...MB``, in MiB) as found in public logs; they move
by a few MiB between drivers. Where no such log was found the entry says so and takes
``_DRIVER_RESERVE_FRACTION`` off the ``nvidia-smi`` total instead.

Note 2: tensor throughput. ``peak_fp16_flops``/``peak_bf16_flops`` are *dense* tensor-core rates
with fp32 accumulate (what mixed-precision training runs); NVIDIA datasheets often quote the 2:4
sparse rate, which we halve. GeForce cards run fp32-accumulate at half their fp16-accumulate rate;
Quadro/RTX-A and datacenter cards run it at full rate. Cards without tensor cores give their plain
fp16 rate (1/64 of fp32 on GP102). Where a card comes as SXM and PCIe, the entry is the SXM part.

Note 3: host link. ``host_link_bytes_per_s`` is a realistic one-direction pinned-memory copy rate,
not the link's raw rate: PCIe 3.0 x16 ~12e9, 4.0 x16 ~25e9, 5.0 x16 ~50e9 B/s.

Note 4: memory torch does not report as tensors. The CUDA context (driver state plus the
kernels of the libraries loaded, with lazy module loading, the default since CUDA 11.7) is
device memory that ``torch.cuda.memory_allocated`` never sees: ``cuda_context_bytes`` is a
per-architecture figure (``_CONTEXT_BYTES``, approximate, checked by ``benchmarks/gpu_check.py``
where a GPU is lent). The cuBLAS workspace *is* allocated through the caching allocator, at
the first matmul, and kept: PyTorch's default ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:8``
(32 MiB) on sm90 and later and ``:4096:2:16:8`` (8 MiB + 128 KiB) before, plus a 1 MiB
cuBLASLt workspace (``CUBLASLT_WORKSPACE_SIZE``); see ``getChosenWorkspaceSize`` in
aten/src/ATen/cuda/CublasHandlePool.cpp.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from dataclasses import dataclass, replace

import torch

from memfit.units import GiB, MiB

__all__ = ["DeviceSpec", "GPUS", "ALIASES", "cpu_spec", "get_device", "list_devices"]

_PCIE3 = 12e9  # B/s, PCIe 3.0 x16 one direction (Note 3)
_PCIE4 = 25e9  # B/s, PCIe 4.0 x16
_PCIE5 = 50e9  # B/s, PCIe 5.0 x16

# Fraction of the nvidia-smi total the driver keeps out of cudaMemGetInfo where no measured figure
# was found (Note 1). Measured: H100 81,559 -> 81,089 MiB (0.6%), H200 143,771 -> 143,156 MiB
# (0.4%); 2% is on the safe side for a memory planner.
_DRIVER_RESERVE_FRACTION = 0.02

_ARCH_BY_CC = {(6, 0): "pascal", (6, 1): "pascal", (7, 0): "volta", (7, 5): "turing",
               (8, 0): "ampere", (8, 6): "ampere", (8, 7): "ampere", (8, 9): "ada",
               (9, 0): "hopper", (10, 0): "blackwell", (12, 0): "blackwell"}


@dataclass(frozen=True)
class DeviceSpec:
    """One device's memory, throughput and bandwidth; see the notes at the top of this file."""

    name: str  # canonical table key, e.g. "gtx-1080-ti"
    display_name: str  # as the vendor names it, e.g. "NVIDIA GeForce GTX 1080 Ti"
    kind: str  # "cuda" or "cpu"
    memory_bytes: int  # bytes, the memory as sold (Note 1)
    usable_bytes: int  # bytes, the total cudaMemGetInfo reports (Note 1)
    peak_fp32_flops: float  # FLOP/s, plain fp32 (no TF32)
    peak_fp16_flops: float  # FLOP/s, dense tensor-core fp16 with fp32 accumulate (Note 2)
    peak_bf16_flops: float  # FLOP/s, dense tensor-core bf16; 0.0 where bf16 is unsupported
    memory_bandwidth_bytes_per_s: float  # B/s, device memory peak bandwidth
    host_link_bytes_per_s: float  # B/s, one-direction host<->device copy rate (Note 3)
    supports_bf16: bool  # whether bf16 matmuls run natively
    compute_capability: tuple[int, int]  # CUDA (major, minor); (0, 0) for the CPU
    architecture: str  # "pascal", "volta", "turing", "ampere", "ada", "hopper", ..., "cpu"
    cuda_context_bytes: int = 0  # bytes the CUDA context and loaded kernels take (Note 4)
    cublas_workspace_bytes: int = 0  # bytes of cuBLAS + cuBLASLt workspace, allocated once (Note 4)

    def __post_init__(self) -> None:
        where = f"DeviceSpec {self.name!r}"
        if not self.name:
            raise ValueError("DeviceSpec.name must be a non-empty string, e.g. 'gtx-1080-ti'")
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"{where}: kind must be 'cuda' or 'cpu', got {self.kind!r}")
        for field in ("memory_bytes", "usable_bytes", "peak_fp32_flops", "peak_fp16_flops",
                      "memory_bandwidth_bytes_per_s", "host_link_bytes_per_s"):
            value = getattr(self, field)
            if not value > 0:
                raise ValueError(f"{where}: {field} must be positive, got {value!r}")
        if self.peak_bf16_flops < 0:
            raise ValueError(f"{where}: peak_bf16_flops must be >= 0, got {self.peak_bf16_flops!r}")
        if self.usable_bytes > self.memory_bytes:
            raise ValueError(f"{where}: usable_bytes ({self.usable_bytes}) cannot exceed "
                             f"memory_bytes ({self.memory_bytes})")
        if self.supports_bf16 != (self.peak_bf16_flops > 0):
            raise ValueError(f"{where}: supports_bf16={self.supports_bf16} but peak_bf16_flops="
                             f"{self.peak_bf16_flops!r}; give bf16 FLOP/s exactly when bf16 "
                             "is supported")
        cc = self.compute_capability
        if len(cc) != 2 or any(not isinstance(v, int) or v < 0 for v in cc):
            raise ValueError(f"{where}: compute_capability must be (major, minor) ints >= 0, got {cc!r}")

    @property
    def reserved_bytes(self) -> int:
        """Bytes of ``memory_bytes`` the driver/ECC keeps from CUDA (memory_bytes - usable_bytes)."""
        return self.memory_bytes - self.usable_bytes

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Peak dense FLOP/s for matmuls in ``dtype`` (float32, float16 or bfloat16)."""
        if dtype == torch.float32:
            return self.peak_fp32_flops
        if dtype == torch.float16:
            return self.peak_fp16_flops
        if dtype == torch.bfloat16:
            if not self.supports_bf16:
                raise ValueError(f"{self.display_name} ({self.name}) has no native bf16; "
                                 "train in torch.float16 (with a GradScaler) or torch.float32")
            return self.peak_bf16_flops
        raise ValueError(f"no peak rate recorded for {dtype}; use torch.float32, torch.float16 "
                         "or torch.bfloat16")


_CONTEXT_BYTES = {"pascal": 300 * MiB, "volta": 320 * MiB, "turing": 320 * MiB,
                  "ampere": 420 * MiB, "ada": 420 * MiB, "hopper": 520 * MiB,
                  "blackwell": 560 * MiB}   # Note 4: approximate, unvalidated


def _cublas_workspace_bytes(cc: tuple[int, int]) -> int:
    """Note 4: cuBLAS default workspace by compute capability, plus cuBLASLt's 1 MiB."""
    cublas = 4096 * 1024 * 8 if cc[0] >= 9 else (4096 * 2 + 16 * 8) * 1024
    return cublas + 1024 * 1024


def _gpu(name: str, display_name: str, *, memory_bytes: int, usable_bytes: int, fp32: float,
         fp16: float, bf16: float, bandwidth: float, host_link: float,
         cc: tuple[int, int]) -> DeviceSpec:
    """A table entry: units as in DeviceSpec (bytes, FLOP/s, B/s); architecture from ``cc``."""
    return DeviceSpec(name=name, display_name=display_name, kind="cuda", memory_bytes=memory_bytes,
                      usable_bytes=usable_bytes, peak_fp32_flops=fp32, peak_fp16_flops=fp16,
                      peak_bf16_flops=bf16, memory_bandwidth_bytes_per_s=bandwidth,
                      host_link_bytes_per_s=host_link, supports_bf16=bf16 > 0,
                      compute_capability=cc, architecture=_ARCH_BY_CC[cc],
                      cuda_context_bytes=_CONTEXT_BYTES[_ARCH_BY_CC[cc]],
                      cublas_workspace_bytes=_cublas_workspace_bytes(cc))


_TABLE = (
    # NVIDIA GeForce GTX 1080 Ti spec page (3584 cores x 1582 MHz boost); Pascal GP102 runs fp16
    # at 1/64 of fp32 and has no tensor cores. CUDA total 11,178 MiB ("10.92 GiB total capacity").
    _gpu("gtx-1080-ti", "NVIDIA GeForce GTX 1080 Ti", memory_bytes=11 * GiB, usable_bytes=11_178 * MiB,
         fp32=11.34e12, fp16=11.34e12 / 64, bf16=0.0, bandwidth=484e9, host_link=_PCIE3, cc=(6, 1)),
    # NVIDIA Turing architecture whitepaper, RTX 2080 Ti reference clocks (GeForce: fp32 accumulate
    # at half rate). CUDA total 11,019 MiB.
    _gpu("rtx-2080-ti", "NVIDIA GeForce RTX 2080 Ti", memory_bytes=11 * GiB, usable_bytes=11_019 * MiB,
         fp32=13.45e12, fp16=53.8e12, bf16=0.0, bandwidth=616e9, host_link=_PCIE3, cc=(7, 5)),
    # NVIDIA T4 datasheet: 8.1 TFLOPS fp32, 65 TFLOPS mixed fp16/fp32, 320 GB/s. ECC on by default
    # (nvidia-smi 15,360 MiB = 15/16 of 16 GiB); CUDA total 15,095-15,109 MiB across drivers.
    _gpu("t4", "NVIDIA Tesla T4", memory_bytes=16 * GiB, usable_bytes=15_095 * MiB,
         fp32=8.1e12, fp16=65e12, bf16=0.0, bandwidth=320e9, host_link=_PCIE3, cc=(7, 5)),
    # NVIDIA Tesla V100 datasheet, SXM2: 15.7 TFLOPS fp32, 125 TFLOPS tensor, 900 GB/s (PCIe part:
    # 14 / 112). CUDA total 16,160 MiB.
    _gpu("v100-16gb", "NVIDIA Tesla V100-SXM2-16GB", memory_bytes=16 * GiB, usable_bytes=16_160 * MiB,
         fp32=15.7e12, fp16=125e12, bf16=0.0, bandwidth=900e9, host_link=_PCIE3, cc=(7, 0)),
    # NVIDIA Tesla V100 datasheet, SXM2 32 GB. CUDA total 32,510 MiB.
    _gpu("v100-32gb", "NVIDIA Tesla V100-SXM2-32GB", memory_bytes=32 * GiB, usable_bytes=32_510 * MiB,
         fp32=15.7e12, fp16=125e12, bf16=0.0, bandwidth=900e9, host_link=_PCIE3, cc=(7, 0)),
    # NVIDIA Quadro RTX 6000 datasheet: 16.3 TFLOPS fp32, 130.5 TFLOPS tensor, 672 GB/s, PCIe 3.0.
    # CUDA total 24,220 MiB with ECC off (its default); with ECC on about 22,698 MiB.
    _gpu("rtx-6000", "NVIDIA Quadro RTX 6000", memory_bytes=24 * GiB, usable_bytes=24_220 * MiB,
         fp32=16.3e12, fp16=130.5e12, bf16=0.0, bandwidth=672e9, host_link=_PCIE3, cc=(7, 5)),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: 35.6 TFLOPS fp32, 71 TFLOPS fp16/bf16 tensor with
    # fp32 accumulate, 936 GB/s. CUDA total 24,259-24,268 MiB.
    _gpu("rtx-3090", "NVIDIA GeForce RTX 3090", memory_bytes=24 * GiB, usable_bytes=24_259 * MiB,
         fp32=35.6e12, fp16=71e12, bf16=71e12, bandwidth=936e9, host_link=_PCIE4, cc=(8, 6)),
    # NVIDIA Ada Lovelace whitepaper, RTX 4090: 82.6 TFLOPS fp32, 165.2 TFLOPS fp16/bf16 tensor with
    # fp32 accumulate, 1008 GB/s. CUDA total 24,563 MiB on a recent driver (some report less).
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090", memory_bytes=24 * GiB, usable_bytes=24_563 * MiB,
         fp32=82.6e12, fp16=165.2e12, bf16=165.2e12, bandwidth=1008e9, host_link=_PCIE4, cc=(8, 9)),
    # NVIDIA RTX A6000 datasheet: 38.7 TFLOPS fp32, 309.7 TFLOPS tensor with sparsity, 768 GB/s.
    # CUDA total 48,676 MiB (ECC off).
    _gpu("rtx-a6000", "NVIDIA RTX A6000", memory_bytes=48 * GiB, usable_bytes=48_676 * MiB,
         fp32=38.7e12, fp16=309.7e12 / 2, bf16=309.7e12 / 2, bandwidth=768e9, host_link=_PCIE4,
         cc=(8, 6)),
    # NVIDIA L4 datasheet: 30.3 TFLOPS fp32, 242 TFLOPS fp16/bf16 with sparsity, 300 GB/s. ECC on:
    # nvidia-smi 23,034 MiB. No measured CUDA total found: _DRIVER_RESERVE_FRACTION taken off.
    _gpu("l4", "NVIDIA L4", memory_bytes=24 * GiB,
         usable_bytes=int(23_034 * MiB * (1 - _DRIVER_RESERVE_FRACTION)) // MiB * MiB,
         fp32=30.3e12, fp16=242e12 / 2, bf16=242e12 / 2, bandwidth=300e9, host_link=_PCIE4, cc=(8, 9)),
    # NVIDIA A100 datasheet, SXM 40 GB: 19.5 TFLOPS fp32, 312 TFLOPS fp16/bf16 dense, 1555 GB/s.
    # CUDA total 40,536 MiB.
    _gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", memory_bytes=40 * GiB, usable_bytes=40_536 * MiB,
         fp32=19.5e12, fp16=312e12, bf16=312e12, bandwidth=1555e9, host_link=_PCIE4, cc=(8, 0)),
    # NVIDIA A100 datasheet, SXM 80 GB: 2039 GB/s (the PCIe 80 GB part: 1935 GB/s). CUDA total about
    # 81,251 MiB (OOM messages: "79.35 GiB total capacity").
    _gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", memory_bytes=80 * GiB, usable_bytes=81_251 * MiB,
         fp32=19.5e12, fp16=312e12, bf16=312e12, bandwidth=2039e9, host_link=_PCIE4, cc=(8, 0)),
    # NVIDIA H100 datasheet, SXM5: 67 TFLOPS fp32, 1979 TFLOPS fp16/bf16 with sparsity, 3.35 TB/s.
    # CUDA total 81,082-81,090 MiB.
    _gpu("h100-80gb", "NVIDIA H100 80GB HBM3", memory_bytes=80 * GiB, usable_bytes=81_089 * MiB,
         fp32=67e12, fp16=1979e12 / 2, bf16=1979e12 / 2, bandwidth=3.35e12, host_link=_PCIE5,
         cc=(9, 0)),
    # NVIDIA H200 datasheet, SXM: 141 GB HBM3e (read as GiB, Note 1), 4.8 TB/s, 67 TFLOPS fp32,
    # 1979 TFLOPS fp16/bf16 with sparsity. CUDA total 143,156 MiB (139.8 GiB).
    _gpu("h200", "NVIDIA H200", memory_bytes=141 * GiB, usable_bytes=143_156 * MiB,
         fp32=67e12, fp16=1979e12 / 2, bf16=1979e12 / 2, bandwidth=4.8e12, host_link=_PCIE5,
         cc=(9, 0)),
)

GPUS: dict[str, DeviceSpec] = {spec.name: spec for spec in _TABLE}
"""Known GPUs by canonical name, roughly oldest first."""

# Other spellings -> canonical name. Matching ignores case, separators and the words "nvidia",
# "geforce", "tesla", "quadro" (see _normalize), so "GTX 1080 Ti" and "nvidia-geforce-gtx-1080-ti"
# need no entry of their own. A bare model name picks the first (smallest-memory) variant, the
# cautious choice for a memory planner: "v100" -> v100-16gb, "a100" -> a100-40gb. PCIe variants
# resolve to the SXM entry (same memory, somewhat lower clocks and bandwidth).
ALIASES: dict[str, str] = {
    "1080ti": "gtx-1080-ti", "1080-ti": "gtx-1080-ti",
    "2080ti": "rtx-2080-ti", "2080-ti": "rtx-2080-ti",
    "t4-16gb": "t4",
    "v100": "v100-16gb", "v100-16": "v100-16gb", "v100-32": "v100-32gb",
    "v100-sxm2-16gb": "v100-16gb", "v100-pcie-16gb": "v100-16gb",
    "v100-sxm2-32gb": "v100-32gb", "v100-pcie-32gb": "v100-32gb",
    "3090": "rtx-3090", "4090": "rtx-4090",
    "rtx6000": "rtx-6000", "quadro-rtx-6000": "rtx-6000",
    "a6000": "rtx-a6000",
    "a100": "a100-40gb", "a100-40": "a100-40gb", "a100-80": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb", "a100-pcie-40gb": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb", "a100-80gb-pcie": "a100-80gb",
    "h100": "h100-80gb", "h100-80": "h100-80gb", "h100-sxm": "h100-80gb", "h100-sxm5": "h100-80gb",
    "h100-80gb-hbm3": "h100-80gb",
    "h200-141gb": "h200", "h200-sxm": "h200",
}


def _normalize(name: str) -> str:
    """'NVIDIA GeForce GTX 1080 Ti' -> 'gtx1080ti': lowercase, vendor words and separators dropped."""
    return re.sub(r"[^a-z0-9]", "", re.sub(r"nvidia|geforce|tesla|quadro", "", name.lower()))


_INDEX: dict[str, str] = {_normalize(k): v for k, v in ALIASES.items()}
_INDEX.update({_normalize(n): n for n in GPUS})
_INDEX.update({_normalize(s.display_name): n for n, s in GPUS.items()})


def list_devices() -> list[DeviceSpec]:
    """The GPU table, oldest first. ``get_device`` also takes "cpu" and "cuda"/"cuda:N"."""
    return list(GPUS.values())


def cpu_spec() -> DeviceSpec:
    """The host CPU as a device: memory is physical RAM; throughputs are rough guesses.

    fp32 peak: logical cores x 2.5 GHz x 32 FLOP/cycle (two 8-wide AVX2 FMA units), the same for
    fp16/bf16 (no faster units assumed). Bandwidth: 50 GB/s, a dual-channel DDR4/DDR5 desktop;
    the host "link" is a RAM-to-RAM copy at that rate.
    """
    if not hasattr(os, "sysconf"):
        raise ValueError("cannot read physical RAM on this platform (no os.sysconf); pass a "
                         "DeviceSpec(kind='cpu', memory_bytes=..., ...) to memfit instead")
    ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    flops = cores * 2.5e9 * 32
    return DeviceSpec(name="cpu", display_name=f"host CPU ({cores} logical cores)", kind="cpu",
                      memory_bytes=ram_bytes, usable_bytes=ram_bytes, peak_fp32_flops=flops,
                      peak_fp16_flops=flops, peak_bf16_flops=flops, memory_bandwidth_bytes_per_s=50e9,
                      host_link_bytes_per_s=50e9, supports_bf16=True, compute_capability=(0, 0),
                      architecture="cpu")


def _spec_from_cuda(device: torch.device) -> DeviceSpec:
    """Describe a local CUDA device: the table entry when its name is known, else rough estimates."""
    if not torch.cuda.is_available():
        raise ValueError("no CUDA device here; name a GPU from the table, e.g. 'gtx-1080-ti'")
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"no CUDA device {index} here: this machine has {count}; "
                         f"use 'cuda:0' .. 'cuda:{count - 1}'")
    props = torch.cuda.get_device_properties(index)
    total = int(props.total_memory)
    known = _INDEX.get(_normalize(props.name))
    if known is not None:
        spec = GPUS[known]
        return replace(spec, usable_bytes=total, memory_bytes=max(spec.memory_bytes, total))
    cc = (int(props.major), int(props.minor))
    warnings.warn(f"{props.name} (sm_{cc[0]}{cc[1]}) is not in memfit.devices.GPUS: its memory is "
                  "measured, but FLOP/s and bandwidth are rough guesses; pass a DeviceSpec with "
                  "datasheet numbers for time estimates", stacklevel=3)
    # Rough: 128 fp32 lanes/SM x 2 FLOP x 1.5 GHz; tensor cores ~4x that from Volta on.
    fp32 = props.multi_processor_count * 128 * 2 * 1.5e9
    fp16 = fp32 * 4 if cc >= (7, 0) else fp32 / 64
    bf16 = fp16 if cc >= (8, 0) else 0.0
    link = _PCIE5 if cc >= (9, 0) else _PCIE4 if cc >= (8, 0) else _PCIE3
    return DeviceSpec(name=_normalize(props.name) or f"cuda-{index}", display_name=props.name,
                      kind="cuda", memory_bytes=-(-total // GiB) * GiB, usable_bytes=total,
                      peak_fp32_flops=fp32, peak_fp16_flops=fp16, peak_bf16_flops=bf16,
                      memory_bandwidth_bytes_per_s=500e9, host_link_bytes_per_s=link,
                      supports_bf16=bf16 > 0, compute_capability=cc,
                      architecture=_ARCH_BY_CC.get(cc, f"sm_{cc[0]}{cc[1]}"),
                      cuda_context_bytes=_CONTEXT_BYTES.get(_ARCH_BY_CC.get(cc), 400 * MiB),
                      cublas_workspace_bytes=_cublas_workspace_bytes(cc))


def get_device(name_or_spec: DeviceSpec | str | torch.device) -> DeviceSpec:
    """Resolve a device: a DeviceSpec (as is), "cpu", "cuda"/"cuda:N"/torch.device, or a GPU name.

    GPU names are the keys of :data:`GPUS` or :data:`ALIASES`, in any case and spacing
    ("GTX 1080 Ti", "1080ti", "a100-80"). Raises ValueError, with close names, for unknown ones.
    """
    if isinstance(name_or_spec, DeviceSpec):
        return name_or_spec
    if isinstance(name_or_spec, torch.device):
        if name_or_spec.type == "cpu":
            return cpu_spec()
        if name_or_spec.type == "cuda":
            return _spec_from_cuda(name_or_spec)
        raise ValueError(f"memfit has no spec for torch device type {name_or_spec.type!r}; "
                         "use 'cpu', 'cuda' or a GPU name such as 'gtx-1080-ti'")
    if not isinstance(name_or_spec, str):
        raise ValueError(f"get_device takes a DeviceSpec, a torch.device or a name, "
                         f"got {type(name_or_spec).__name__}")
    text = name_or_spec.strip().lower()
    if text == "cpu":
        return cpu_spec()
    if text == "cuda" or re.fullmatch(r"cuda:\d+", text):
        return _spec_from_cuda(torch.device(text))
    key = _normalize(text)
    if key in _INDEX:
        return GPUS[_INDEX[key]]
    close = difflib.get_close_matches(key, list(_INDEX), n=6, cutoff=0.7)
    suggestions = list(dict.fromkeys(_INDEX[c] for c in close))[:3]
    hint = f"did you mean {', '.join(repr(s) for s in suggestions)}? " if suggestions else ""
    raise ValueError(f"unknown device {name_or_spec!r}: {hint}List the known GPUs with "
                     "memfit.devices.list_devices(), or pass 'cpu', 'cuda' or a DeviceSpec")
