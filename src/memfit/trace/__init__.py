"""Symbolic steps: run the canonical step on fake tensors and count it like a real one."""

from memfit.trace.fake import FakeCopier
from memfit.trace.profile import StepProfile, profile_step

__all__ = ["FakeCopier", "StepProfile", "profile_step"]
