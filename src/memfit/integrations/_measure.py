"""What the integrations' callbacks share: one measured step, and NVML's view of the card."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepMemory", "nvml_used_bytes"]


@dataclass
class StepMemory:
    """One measured step of a callback (predicted vs measured). Bytes; None where the device
    has no such figure."""

    step: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_reserved_bytes: int | None = None
    measured_reserved_bytes: int | None = None
    nvml_used_bytes: int | None = None

    @property
    def error(self) -> float:
        """(measured - predicted) / predicted, allocated peaks."""
        return (self.measured_peak_bytes - self.predicted_peak_bytes) / self.predicted_peak_bytes


def nvml_used_bytes() -> int | None:
    """The current CUDA device's used memory by NVML (every process and the CUDA context
    included), when pynvml imports; else None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except pynvml.NVMLError:
        return None
