"""The known values of a fake trace, indexed by storage (``trace.data_dependent``)."""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary, WeakIdRef

__all__ = ["KnownOnStorages"]


class KnownOnStorages(WeakIdKeyDictionary):
    """Fake tensor -> its real values (``trace.data_dependent.DataValues``), with the fakes on
    each storage at hand: an in-place op forgets every known fake on the storages it wrote,
    and scanning every known tensor for each one made an optimizer's step, a write on each
    parameter's known step counter, quadratic in the parameters. The index keeps torch's
    ``WeakIdRef`` of each fake, as the dictionary does (a tensor's Python object can be
    resurrected), and a fake is taken only while its storage is still the one it was indexed
    under."""

    def __init__(self):
        super().__init__()
        self._on_storage: dict[int, list[WeakIdRef]] = {}
        # the ids of every fake ever known: a tensor not among them is not known, told without
        # the ``WeakIdRef`` a lookup makes (an op asks of each of its tensors); an id reused
        # after its fake died is asked of the dictionary as before
        self._ids: set[int] = set()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._ids.add(id(key))
        self._on_storage.setdefault(key.untyped_storage()._cdata, []).append(WeakIdRef(key))

    def __contains__(self, key) -> bool:
        return id(key) in self._ids and super().__contains__(key)

    def get(self, key, default=None):
        return super().get(key, default) if id(key) in self._ids else default

    def on_storages(self, storages: set[int]) -> list[torch.Tensor]:
        """The known fakes on these storages (by ``_cdata``)."""
        out = []
        for cdata in storages:
            refs = [r for r in self._on_storage.pop(cdata, ()) if r() is not None]
            if refs:
                self._on_storage[cdata] = refs
            out += [t for r in refs if (t := r()) is not None and t in self and
                    t.untyped_storage()._cdata == cdata]
        return out
