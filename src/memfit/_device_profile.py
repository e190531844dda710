"""A device profile: what ``memfit calibrate`` measured on one GPU, as JSON, read back as a
``DeviceSpec`` whose figures are the measured ones (``DeviceSpec.load``).

Note 1 (the format, version 1). One object::

    {"memfit_device_profile": 1,
     "gpu": {"name": "NVIDIA A10G", "compute_capability": [8, 6],
             "total_memory_bytes": ..., "nvml_total_bytes": ... or null},
     "driver": "535.129.03" or null, "cuda": "12.4", "torch": "2.5.1+cu124",
     "module_loading": "lazy" | "eager",
     "measured": {"context_bytes": ..., "library_kernels_bytes": ..., "cudnn_bytes": ...,
                  "cublas_workspace_bytes": ..., "allocator": {...}, "step": {...}},
     "recorded": {"memfit": "...", "date": "...", "seconds": ...}}

``context_bytes`` is the bare context (device bytes used outside the allocator after CUDA
initialised), ``library_kernels_bytes`` what the first matmuls and a step's kernels added to
it, ``cudnn_bytes`` what the first convolution added, ``cublas_workspace_bytes`` what the first
matmul left allocated. ``allocator`` and ``step`` are records (read, not used by the spec).

Note 2 (the spec). The GPU's table entry by name (FLOP/s and bandwidths from its datasheet) with
the measured figures in place of the modelled ones; an unknown GPU takes the rough rates
``memfit.devices`` gives any unlisted card, with a warning. Every field is checked: a bad file is
a ValueError naming the file, the field and what it should be.
"""

from __future__ import annotations

import json
from dataclasses import replace

from memfit._cuda_overhead import parse_cuda_version

__all__ = ["load_profile", "FORMAT_VERSION", "check_profile"]

FORMAT_VERSION = 1
_MEASURED = ("context_bytes", "library_kernels_bytes", "cudnn_bytes", "cublas_workspace_bytes")


def _fail(path: str, what: str) -> ValueError:
    return ValueError(f"device profile {path}: {what}; measure one with `memfit calibrate` on the "
                      "GPU (or fix the file)")


def _bytes(path: str, where: str, value, *, positive: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
        raise _fail(path, f"{where} must be a whole number of bytes "
                          f"{'> 0' if positive else '>= 0'}, got {value!r}")
    return value


def check_profile(data, path: str = "<profile>") -> dict:
    """``data`` checked against Note 1 (ValueError for the first problem found)."""
    if not isinstance(data, dict):
        raise _fail(path, f"the top level must be a JSON object, got {type(data).__name__}")
    version = data.get("memfit_device_profile")
    if version != FORMAT_VERSION:
        raise _fail(path, f"memfit_device_profile must be {FORMAT_VERSION} (the format this memfit "
                          f"reads), got {version!r}")
    gpu = data.get("gpu")
    if not isinstance(gpu, dict):
        raise _fail(path, "'gpu' must be an object with name, compute_capability, "
                          "total_memory_bytes")
    if not isinstance(gpu.get("name"), str) or not gpu["name"].strip():
        raise _fail(path, f"gpu.name must be the GPU's name, got {gpu.get('name')!r}")
    cc = gpu.get("compute_capability")
    if not (isinstance(cc, list) and len(cc) == 2 and all(isinstance(v, int) and v >= 0
                                                          for v in cc)):
        raise _fail(path, f"gpu.compute_capability must be [major, minor], got {cc!r}")
    _bytes(path, "gpu.total_memory_bytes", gpu.get("total_memory_bytes"), positive=True)
    if gpu.get("nvml_total_bytes") is not None:
        _bytes(path, "gpu.nvml_total_bytes", gpu["nvml_total_bytes"], positive=True)
        if gpu["nvml_total_bytes"] < gpu["total_memory_bytes"]:
            raise _fail(path, "gpu.nvml_total_bytes is the card's whole memory, so it cannot be "
                              "less than gpu.total_memory_bytes")
    for key in ("cuda", "torch"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise _fail(path, f"{key!r} must be a version string, got {data.get(key)!r}")
    if data.get("module_loading") not in ("lazy", "eager"):
        raise _fail(path, f"module_loading must be 'lazy' or 'eager', got "
                          f"{data.get('module_loading')!r}")
    measured = data.get("measured")
    if not isinstance(measured, dict):
        raise _fail(path, f"'measured' must be an object with {', '.join(_MEASURED)}")
    for key in _MEASURED:
        _bytes(path, f"measured.{key}", measured.get(key))
    if measured["context_bytes"] == 0:
        raise _fail(path, "measured.context_bytes is 0: a CUDA context always takes device "
                          "memory, so this was not measured")
    if measured["context_bytes"] + measured["library_kernels_bytes"] >= gpu["total_memory_bytes"]:
        raise _fail(path, "measured context and kernels are more than the GPU's memory")
    return data


def load_profile(path: str, table_spec):
    """The DeviceSpec a profile describes (Note 2); ``table_spec(gpu, total_bytes)`` is the
    table's spec of the profile's GPU (``memfit.devices``, which calls this)."""

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"device profile {path}: no such file; write one with `memfit calibrate "
                         f"--output {path}` on the GPU") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise ValueError(f"device profile {path}: cannot read it ({e.__class__.__name__})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    check_profile(data, path)
    gpu, m = data["gpu"], data["measured"]
    try:
        cuda = parse_cuda_version(data["cuda"])
    except ValueError as e:
        raise _fail(path, f"cuda: {e}") from None
    total = gpu["total_memory_bytes"]
    base = table_spec(gpu, total)
    card = gpu.get("nvml_total_bytes") or max(base.memory_bytes, total)
    source = f"measured by memfit calibrate on this {gpu['name']} ({path})"
    return replace(base, usable_bytes=total, memory_bytes=max(card, total), usable_measured=True,
                   cuda_version=cuda, module_loading=data["module_loading"],
                   cuda_context_bytes=m["context_bytes"] + m["library_kernels_bytes"],
                   library_kernels_bytes=m["library_kernels_bytes"], cudnn_bytes=m["cudnn_bytes"],
                   cublas_workspace_bytes=m["cublas_workspace_bytes"],
                   figure_notes=(f"CUDA {data['cuda']}, driver {data.get('driver') or 'unknown'}, "
                                 f"torch {data['torch']}: context and kernels {source}",),
                   profile_path=path, nvml_total_bytes=gpu.get("nvml_total_bytes") or 0)
