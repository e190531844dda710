"""What the integrations' callbacks share: measuring the first steps of a real run
(``StepMeter``), one measured step (``StepMemory``), and NVML's view of the card."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import memfit

__all__ = ["StepMeter", "StepMemory", "nvml_used_bytes"]


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


class StepMeter:
    """Measures steps of a real run. On CUDA: the allocator's peak over each step (stats reset
    at its start) and NVML's used bytes at its end. Elsewhere: one ``memfit.track`` opened by
    ``open`` (so everything the loop makes is counted from its birth), read over each step."""

    def __init__(self):
        self.cuda = False
        self._tracker = None

    def open(self, model, optimizer) -> None:
        p = next(model.parameters(), None) if model is not None else None
        self.cuda = p is not None and p.device.type == "cuda"
        if not self.cuda:
            self._tracker = memfit.track(model, optimizer)
            self._tracker.__enter__()

    @property
    def measuring(self) -> bool:
        return self.cuda or self._tracker is not None

    def begin(self) -> None:
        """A step starts."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self._tracker is not None:
            self._tracker.start_window()

    def end(self, step: int, predicted_peak_bytes: int,
            predicted_reserved_bytes: int | None = None) -> StepMemory | None:
        """The step that began last, measured (None when not measuring)."""
        if self.cuda:
            torch.cuda.synchronize()
            return StepMemory(step, predicted_peak_bytes, torch.cuda.max_memory_allocated(),
                              predicted_reserved_bytes, torch.cuda.max_memory_reserved(),
                              nvml_used_bytes())
        if self._tracker is None:
            return None
        return StepMemory(step, predicted_peak_bytes, self._tracker.peak_bytes)

    def close(self) -> None:
        if self._tracker is not None:
            t, self._tracker = self._tracker, None
            t.__exit__(None, None, None)
