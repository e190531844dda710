"""memfit: make a PyTorch training step fit the GPU memory you have."""

from memfit.errors import BudgetTooSmall, OutOfMemory, TraceError
from memfit.measure import Tracker, track
from memfit.units import format_bytes, parse_bytes

__all__ = ["BudgetTooSmall", "OutOfMemory", "TraceError", "Tracker", "format_bytes",
           "parse_bytes", "track"]
__version__ = "0.1.0"
