"""Studies built on the planner, outside the core import graph: what-if over the config levers
(sequence length, hidden size, layer count) and a progressive sequence-length schedule. They ask
``memfit.api`` (estimate, plan) and nothing in the core imports them."""

from memfit.studies.progressive import Phase, ProgressiveSchedule, progressive
from memfit.studies.what_if import WhatIfRow, what_if

__all__ = ["Phase", "ProgressiveSchedule", "WhatIfRow", "progressive", "what_if"]
