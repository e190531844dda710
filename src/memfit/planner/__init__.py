"""Plans: which knobs a step runs with, and what memfit predicts for them."""

from memfit.planner.plan import Plan

__all__ = ["Plan"]
