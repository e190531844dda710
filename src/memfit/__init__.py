"""memfit: make a PyTorch training step fit the GPU memory you have."""

from memfit.api import Estimate, estimate, fit, largest_fitting, plan, progressive, what_if
from memfit.api.remat import remat
from memfit.devices import DeviceSpec, get_device, list_devices
from memfit.errors import BudgetTooSmall, OutOfMemory, TraceError
from memfit.knobs import Knobs
from memfit.measure import Tracker, track
from memfit.planner import Plan
from memfit.runtime import Runner, StepInfo
from memfit.units import format_bytes, parse_bytes

__all__ = ["BudgetTooSmall", "DeviceSpec", "Estimate", "Knobs", "OutOfMemory", "Plan", "Runner",
           "StepInfo", "TraceError", "Tracker", "estimate", "fit", "format_bytes", "get_device",
           "largest_fitting", "list_devices", "parse_bytes", "plan", "progressive", "remat",
           "track", "what_if"]
__version__ = "0.1.0"
