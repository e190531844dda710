"""Executing a plan: the effective-batch Runner."""

from memfit.runtime.runner import Runner, StepInfo

__all__ = ["Runner", "StepInfo"]
