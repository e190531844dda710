"""What a device offers a training step: memory (total and usable), peak throughput, bandwidths.

``get_device("1080ti")`` returns the :class:`DeviceSpec` of a GTX 1080 Ti from the table
:data:`GPUS`; ``get_device("cuda")`` describes the GPU in this machine; ``get_device("cpu")`` the host.

``DeviceSpec``, the table and the host's spec live in ``memfit._device_table``, which needs no
torch (so the CLI lists and checks GPUs without importing it) and says what each figure means;
this module adds what needs torch: the GPU in this machine and ``torch.device`` arguments.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from memfit._device_cuda import cublas_workspace_bytes_for
from memfit._device_table import (_ARCH_BY_CC, _INDEX, _PCIE3, _PCIE4, _PCIE5, ALIASES, GPUS,
                                  DeviceSpec, _normalize, cpu_spec, list_devices, resolve_name,
                                  with_cuda)
from memfit.units import GiB

__all__ = ["DeviceSpec", "GPUS", "ALIASES", "cpu_spec", "get_device", "list_devices", "with_cuda"]


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
        return replace(spec, usable_bytes=total, memory_bytes=max(spec.memory_bytes, total),
                       usable_measured=True)
    cc = (int(props.major), int(props.minor))
    warnings.warn(f"{props.name} (sm_{cc[0]}{cc[1]}) is not in memfit.devices.GPUS: its memory is "
                  "measured, but FLOP/s and bandwidth are rough guesses; pass a DeviceSpec with "
                  "datasheet numbers for time estimates", stacklevel=3)
    # Rough: 128 fp32 lanes/SM x 2 FLOP x 1.5 GHz; tensor cores ~4x that from Volta on.
    fp32 = props.multi_processor_count * 128 * 2 * 1.5e9
    fp16 = fp32 * 4 if cc >= (7, 0) else fp32 / 64
    bf16 = fp16 if cc >= (8, 0) else 0.0
    link = _PCIE5 if cc >= (9, 0) else _PCIE4 if cc >= (8, 0) else _PCIE3
    spec = DeviceSpec(name=_normalize(props.name) or f"cuda-{index}", display_name=props.name,
                      kind="cuda", memory_bytes=-(-total // GiB) * GiB, usable_bytes=total,
                      peak_fp32_flops=fp32, peak_fp16_flops=fp16, peak_bf16_flops=bf16,
                      memory_bandwidth_bytes_per_s=500e9, host_link_bytes_per_s=link,
                      supports_bf16=bf16 > 0, compute_capability=cc,
                      architecture=_ARCH_BY_CC.get(cc, f"sm_{cc[0]}{cc[1]}"),
                      cublas_workspace_bytes=cublas_workspace_bytes_for(cc))
    return with_cuda(spec)


def get_device(name_or_spec: DeviceSpec | str | torch.device, *, cuda_version=None,
               module_loading: str | None = None) -> DeviceSpec:
    """Resolve a device: a DeviceSpec (as is), "cpu", "cuda"/"cuda:N"/torch.device, or a GPU name.

    GPU names are the keys of :data:`GPUS` or :data:`ALIASES`, in any case and spacing
    ("GTX 1080 Ti", "1080ti", "a100-80"). Raises ValueError, with close names, for unknown ones.
    ``cuda_version`` ("12", "12.4") and ``module_loading`` ("lazy", "eager") choose the CUDA the
    context figures assume (``with_cuda``); by default, torch's and lazy.
    """
    spec = _resolve(name_or_spec)
    if cuda_version is None and module_loading is None:
        return spec
    return with_cuda(spec, cuda_version, module_loading)


def _resolve(name_or_spec) -> DeviceSpec:
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
    spec = resolve_name(name_or_spec)
    return spec if spec is not None else _spec_from_cuda(torch.device(name_or_spec.strip().lower()))
