"""A ledger resolved after its region (``measure._ledger``): the live bytes after each event, per
category, and the peak over a window."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Resolved", "CATEGORIES"]

# Categories, strongest first: a storage carries the strongest category it was ever marked with.
CATEGORIES = ("params", "grads", "optimizer", "other", "inputs", "activations", "temporaries")
PARAMS, GRADS, OPTIMIZER, OTHER, INPUTS, ACTIVATIONS, TEMPORARIES = range(len(CATEGORIES))


@dataclass
class Resolved:
    """The ledger resolved after the region: all byte figures include entry storages and
    exclude host storages (counted apart in ``host_peak_bytes``)."""

    series: np.ndarray        # device live bytes after each event (int64)
    by_category: np.ndarray   # [events, categories] device live bytes per category
    base_bytes: int           # device live bytes at the start of the region
    base_by_category: np.ndarray
    peak_bytes: int           # over the window (events >= window_start, and the value before)
    peak_event: int           # index of the event at the peak; -1 = the start of the region
    host_peak_bytes: int      # peak of storages marked as host memory, over the whole region
    window_start: int = 0     # first event of the window the peak is taken over

    def at(self, event: int) -> int:
        return int(self.base_bytes if event < 0 else self.series[event])

    def series_at(self, events: np.ndarray) -> np.ndarray:
        """``at`` of each event, as an array."""
        if not len(self.series):
            return np.full(len(events), self.base_bytes, dtype=np.int64)
        return np.where(events < 0, self.base_bytes, self.series[np.maximum(events, 0)])

    def by_category_at(self, events: np.ndarray) -> np.ndarray:
        """``breakdown_at`` of each event, as rows in ``CATEGORIES`` order."""
        base = np.asarray(self.base_by_category, dtype=np.int64).reshape(1, -1)
        if not len(self.by_category):
            return np.repeat(base, len(events), axis=0)
        rows = self.by_category[np.maximum(events, 0)]
        return np.where((events < 0)[:, None], base, rows)

    def breakdown_at(self, event: int) -> dict[str, int]:
        row = self.base_by_category if event < 0 else self.by_category[event]
        return {name: int(row[i]) for i, name in enumerate(CATEGORIES)}

    def max_between(self, start: int, end: int) -> int:
        """Peak live bytes over events ``start..end`` (inclusive), with the value just before."""
        before = self.at(start - 1)
        if end < start:
            return before
        return max(before, int(self.series[start:end + 1].max()))
