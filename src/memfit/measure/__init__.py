"""Real-run accounting (``track``): the lowest measuring layer."""

from memfit.measure._ledger import CATEGORIES, storages_of
from memfit.measure._modules import ModuleRecord, find_blocks
from memfit.measure.track import Tracker, host_allocations, track

__all__ = ["CATEGORIES", "ModuleRecord", "Tracker", "find_blocks", "host_allocations",
           "storages_of", "track"]
