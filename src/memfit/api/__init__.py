"""Thin fronts: apply the knobs, then trace / search / run."""

from memfit.api.estimate import Estimate, estimate

__all__ = ["Estimate", "estimate"]
