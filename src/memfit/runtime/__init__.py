"""Executing a plan: the effective-batch Runner."""

from memfit.runtime.applied import Applied
from memfit.runtime.runner import Runner, StepInfo

__all__ = ["Applied", "Runner", "StepInfo"]
