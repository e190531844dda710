"""Lifetime-based static memory planning of a traced step (the seed's SOMAS).

``static_plan(memfit.estimate(...))`` lays every storage of the step out in one arena so that no
two storages alive at once overlap, and puts the arena beside the lower bound (the peak of live
bytes) and what PyTorch's caching allocator would reserve; ``allocator_options`` models
separate pools per lifetime class or phase and expandable segments on the same step (the
planner picks the setting that reserves least and counts its bytes: ``api._plan_allocator``);
``ReplayMatcher`` is a replay allocator's matching logic, and ``replay_allocator`` its C++ side
(``_replay_alloc.cpp``, built at first use on a CUDA machine; elsewhere it says why not).
"""

from memfit.memplan._lifetimes import Lifetimes, StorageLog, storage_log
from memfit.memplan._pools import (LIFETIME_CLASSES, AllocatorOption, AllocatorOptions,
                                   allocator_options, lifetime_class)
from memfit.memplan.replay_match import MatchStats, ReplayMatcher
from memfit.memplan.static_plan import Assignment, StaticPlan, plan_lifetimes, static_plan

__all__ = ["Assignment", "AllocatorOption", "AllocatorOptions", "LIFETIME_CLASSES", "Lifetimes",
           "MatchStats", "ReplayMatcher",
           "StaticPlan", "StorageLog", "allocator_options", "lifetime_class", "plan_lifetimes",
           "static_plan", "storage_log"]
