"""Thin fronts: apply the knobs, then trace / search / run."""

from memfit.api.estimate import Estimate, estimate
from memfit.api.fit import fit

__all__ = ["Estimate", "estimate", "fit"]
