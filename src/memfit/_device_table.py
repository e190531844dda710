"""What a device offers a training step, without torch: ``DeviceSpec``, the GPUs memfit knows
(``GPUS``, built from ``memfit._gpu_table``), their names and the host CPU. ``memfit.devices``
is the module to import: it adds what needs torch (the local CUDA GPU, a ``torch.device``);
this one lets ``memfit gpus`` and the CLI's checks of ``--gpu`` answer without importing torch.

Note 1: memory as sold vs usable. ``memory_bytes`` is the card's memory as NVIDIA sells it,
read in binary units ("11 GB" on a 1080 Ti is 11 GiB; "141 GB" on an H200 is 141 GiB, since CUDA
itself reports 143,156 MiB there, more than 141e9 bytes). ``usable_bytes`` is the total that
``cudaMemGetInfo`` / ``torch.cuda.get_device_properties(i).total_memory`` reports: memory_bytes less
what the driver keeps (and, on GDDR cards with ECC on, 1/16 of the memory for check bits). Figures are
the ``total_memory`` torch prints (``total_memory=...MB``, in MiB) as found in public logs; they move
by a few MiB between drivers. Where no such log was found the entry says so, ``usable_measured``
is False, and ``_DRIVER_RESERVE_FRACTION`` is taken off the ``nvidia-smi`` total (or, where no
such total is published either, off ``memory_bytes``). ``memory_bytes - usable_bytes`` is what
the driver (and ECC) keeps of the card: ``reserved_bytes``, the line the card breakdown
(``memfit.trace.card``) adds to a step's device bytes to give the card as NVML counts it.

Note 2: tensor throughput. ``peak_fp16_flops``/``peak_bf16_flops`` are *dense* tensor-core rates
with fp32 accumulate (what mixed-precision training runs); NVIDIA datasheets often quote the 2:4
sparse rate, which we halve. GeForce cards run fp32-accumulate at half their fp16-accumulate rate;
Quadro/RTX-A and datacenter cards run it at full rate. Cards without tensor cores give their plain
fp16 rate (1/64 of fp32 on GP102, 2x on GP100). Where a card comes as SXM and PCIe, the bare name
is the SXM part; the PCIe parts of the A100 and H100 have entries of their own.

Note 3: host link. ``host_link_bytes_per_s`` is a realistic one-direction pinned-memory copy rate,
not the link's raw rate: PCIe 3.0 x16 ~12e9, 4.0 x16 ~25e9 (x8: half), 5.0 x16 ~50e9 B/s; Grace
Hopper's NVLink-C2C is given at its raw 450e9 (no copy-rate measurement found).

The memory a GPU holds outside tensors (the CUDA context, the kernels a step loads, cuDNN), the
cuBLAS workspaces and the CUDA version those figures assume are set by ``with_cuda``, in
``memfit._device_cuda``, whose notes say where each comes from.
"""

from __future__ import annotations

import difflib
import os
import re
import warnings
from dataclasses import dataclass

from memfit import _gpu_table
from memfit._device_cuda import CUBLASLT_WORKSPACE_BYTES, cublas_workspace_bytes_for, with_cuda
from memfit._device_profile import load_profile
from memfit.units import GiB, MiB

__all__ = ["DeviceSpec", "GPUS", "ALIASES", "cpu_spec", "list_devices", "resolve_name",
           "with_cuda"]

_PCIE3 = 12e9  # B/s, PCIe 3.0 x16 one direction (Note 3)
_PCIE4 = 25e9  # B/s, PCIe 4.0 x16
_PCIE5 = 50e9  # B/s, PCIe 5.0 x16
_C2C = 450e9   # B/s, NVLink-C2C (Grace Hopper) one direction, the raw rate (Note 3)

# Fraction of the nvidia-smi total the driver keeps out of cudaMemGetInfo where no measured figure
# was found (Note 1). Measured: H100 81,559 -> 81,089 MiB (0.6%), H200 143,771 -> 143,156 MiB
# (0.4%); 2% is on the safe side for a memory planner.
_DRIVER_RESERVE_FRACTION = 0.02

_ARCH_BY_CC = {(6, 0): "pascal", (6, 1): "pascal", (7, 0): "volta", (7, 5): "turing",
               (8, 0): "ampere", (8, 6): "ampere", (8, 7): "ampere", (8, 9): "ada",
               (9, 0): "hopper", (10, 0): "blackwell", (12, 0): "blackwell"}
# sm_60 (GP100: P100) has no tensor cores but runs fp16 at twice fp32; GP102 (sm_61) at 1/64.


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
    # memory outside tensors and the CUDA it assumes: set by with_cuda (memfit._device_cuda)
    cuda_context_bytes: int = 0  # bytes the CUDA context and loaded kernels take
    cublas_workspace_bytes: int = 0  # bytes of cuBLAS + cuBLASLt workspace, allocated once
    library_kernels_bytes: int = 0  # bytes of cuda_context_bytes a step's first kernels load
    cudnn_bytes: int = 0  # bytes cuDNN adds outside the allocator when convolutions run
    cuda_version: tuple[int, int] | None = None  # CUDA the figures assume; None on CPU
    module_loading: str = "lazy"  # "lazy" or "eager": CUDA_MODULE_LOADING
    figure_notes: tuple[str, ...] = ()  # where the non-allocator figures come from
    usable_measured: bool = True  # usable_bytes read off a log (False: the Note 1 fallback)
    profile_path: str | None = None  # the device profile these figures were measured in, if any
    nvml_total_bytes: int = 0  # the card's total as NVML / nvidia-smi reports it; 0: not known

    @property
    def autograd_workspace_bytes(self) -> int:
        """The cuBLAS workspace of autograd's device thread (its backward's matmuls run there,
        on a handle of their own): the handle's own, without the cuBLASLt one."""
        return max(self.cublas_workspace_bytes - CUBLASLT_WORKSPACE_BYTES, 0)

    @classmethod
    def load(cls, path: str) -> "DeviceSpec":
        """The device a ``memfit calibrate`` profile (JSON) describes, with its measured figures;
        ValueError naming the file and the field for a bad one (``memfit._device_profile``)."""
        return load_profile(path, _table_spec)

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
        for field in ("cuda_context_bytes", "cublas_workspace_bytes", "library_kernels_bytes",
                      "cudnn_bytes"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 0:
                raise ValueError(f"{where}: {field} must be a whole number of bytes >= 0, got "
                                 f"{getattr(self, field)!r}")
        if self.library_kernels_bytes > self.cuda_context_bytes:
            raise ValueError(f"{where}: library_kernels_bytes ({self.library_kernels_bytes}) is "
                             f"part of cuda_context_bytes ({self.cuda_context_bytes}), not more")
        if self.module_loading not in ("lazy", "eager"):
            raise ValueError(f"{where}: module_loading must be 'lazy' or 'eager', got "
                             f"{self.module_loading!r}")
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

    def peak_flops(self, dtype) -> float:
        """Peak dense FLOP/s for matmuls in ``dtype`` (torch.float32, torch.float16 or
        torch.bfloat16; told apart by name, so this module needs no torch)."""
        field = _PEAK_FIELDS.get(str(dtype))
        if field is None:
            raise ValueError(f"no peak rate recorded for {dtype}; use torch.float32, "
                             "torch.float16 or torch.bfloat16")
        if field == "peak_bf16_flops" and not self.supports_bf16:
            raise ValueError(f"{self.display_name} ({self.name}) has no native bf16; "
                             "train in torch.float16 (with a GradScaler) or torch.float32")
        return getattr(self, field)


# str(dtype) -> the DeviceSpec field of its peak rate
_PEAK_FIELDS = {"torch.float32": "peak_fp32_flops", "torch.float16": "peak_fp16_flops",
                "torch.bfloat16": "peak_bf16_flops"}


def _link(name: str) -> float:
    return {"pcie3": _PCIE3, "pcie4": _PCIE4, "pcie4x8": _PCIE4 / 2, "pcie5": _PCIE5,
            "c2c": _C2C}[name]


def _usable_bytes(row: dict) -> int:
    """Note 1: the CUDA total a public log gives, else the fallback off nvidia-smi's total."""
    if row["usable"] is not None:
        return row["usable"] * MiB
    total = row.get("smi", row["mem"] * 1024) * MiB
    return int(total * (1 - _DRIVER_RESERVE_FRACTION)) // MiB * MiB


def _gpu(row: dict) -> DeviceSpec:
    """A table entry from one row of ``memfit._gpu_table`` (units as in DeviceSpec)."""
    cc = row["cc"]
    spec = DeviceSpec(name=row["name"], display_name=row["display"], kind="cuda",
                      memory_bytes=row["mem"] * GiB, usable_bytes=_usable_bytes(row),
                      peak_fp32_flops=row["fp32"], peak_fp16_flops=row["fp16"],
                      peak_bf16_flops=row["bf16"], memory_bandwidth_bytes_per_s=row["bw"],
                      host_link_bytes_per_s=_link(row["link"]), supports_bf16=row["bf16"] > 0,
                      compute_capability=cc, architecture=_ARCH_BY_CC[cc],
                      cublas_workspace_bytes=cublas_workspace_bytes_for(cc),
                      usable_measured=row["usable"] is not None,
                      nvml_total_bytes=row.get("smi", 0) * MiB)
    return with_cuda(spec, module_loading="lazy")


GPUS: dict[str, DeviceSpec] = {row["name"]: _gpu(row) for row in _gpu_table.ROWS}
"""Known GPUs by canonical name (``memfit._gpu_table``), roughly oldest first."""

# Other spellings -> canonical name. Matching ignores case, separators and the words "nvidia",
# "geforce", "tesla", "quadro" (see _normalize), so "GTX 1080 Ti" and "nvidia-geforce-gtx-1080-ti"
# need no entry of their own. A bare model name picks the first (smallest-memory) variant, the
# cautious choice for a memory planner: "v100" -> v100-16gb, "a100" -> a100-40gb.
ALIASES: dict[str, str] = dict(_gpu_table.ALIASES)


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


def resolve_name(name: str) -> DeviceSpec | None:
    """The device a name gives: "cpu", a device profile FILE.json, or a GPU of the table by any
    of its names (in any case and spacing: "GTX 1080 Ti", "1080ti", "a100-80"); None for
    "cuda"/"cuda:N", the GPU in this machine, which only torch can describe
    (``memfit.devices.get_device``). ValueError, with close names, for an unknown name."""
    text = name.strip().lower()
    if text == "cpu":
        return cpu_spec()
    if text == "cuda" or re.fullmatch(r"cuda:\d+", text):
        return None
    if text.endswith(".json"):
        return DeviceSpec.load(name.strip())
    key = _normalize(text)
    if key in _INDEX:
        return GPUS[_INDEX[key]]
    close = difflib.get_close_matches(key, list(_INDEX), n=6, cutoff=0.7)
    suggestions = list(dict.fromkeys(_INDEX[c] for c in close))[:3]
    hint = f"did you mean {', '.join(repr(s) for s in suggestions)}? " if suggestions else ""
    raise ValueError(f"unknown device {name!r}: {hint}List the known GPUs with "
                     "memfit.devices.list_devices(), or pass 'cpu', 'cuda', a device profile "
                     "(FILE.json from `memfit calibrate`) or a DeviceSpec")


def _table_spec(gpu: dict, total: int) -> DeviceSpec:
    """A profiled GPU's table entry, or for a GPU the table does not list, rough rates for its
    compute capability (with a warning): the base a profile's measured figures replace."""
    known = _INDEX.get(_normalize(gpu["name"]))
    if known is not None:
        return GPUS[known]
    cc = tuple(gpu["compute_capability"])
    warnings.warn(f"{gpu['name']} is not in memfit.devices.GPUS: the profile's memory figures are "
                  "measured, FLOP/s and bandwidth are rough guesses", stacklevel=4)
    fp32 = 50e12
    fp16 = fp32 * 4 if cc >= (7, 0) else fp32 / 64
    bf16 = fp16 if cc >= (8, 0) else 0.0
    return DeviceSpec(
        name=_normalize(gpu["name"]) or "profiled-gpu", display_name=gpu["name"],
        kind="cuda", memory_bytes=-(-total // GiB) * GiB, usable_bytes=total,
        peak_fp32_flops=fp32, peak_fp16_flops=fp16, peak_bf16_flops=bf16,
        memory_bandwidth_bytes_per_s=500e9, host_link_bytes_per_s=25e9, supports_bf16=bf16 > 0,
        compute_capability=cc, architecture=_ARCH_BY_CC.get(cc, f"sm_{cc[0]}{cc[1]}"))
