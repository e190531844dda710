"""Thin fronts: apply the knobs, then trace / search / run."""

from memfit.api.estimate import Estimate, estimate
from memfit.api.fit import fit
from memfit.api.levers import largest_fitting
from memfit.api.plan import plan

__all__ = ["Estimate", "estimate", "fit", "largest_fitting", "plan"]
