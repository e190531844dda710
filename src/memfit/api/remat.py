"""``memfit.remat``: dynamic tensor rematerialization around a plain training step."""

from __future__ import annotations

from torch import nn

from memfit.techniques.remat import Remat, RematSession
from memfit.units import parse_bytes

__all__ = ["remat"]


def remat(budget=None, *, model: nn.Module | None = None, optimizer=None,
          min_evict_bytes: int = 4096, sample_size: int = 16) -> RematSession:
    """``with memfit.remat(budget=None):`` around forward + backward + optimizer step.

    Under memory pressure the tensors autograd saved inside the model's blocks are evicted (the
    DTR heuristic: cost / (bytes x staleness), evicted neighbours' cost included) and recomputed
    exactly when backward needs them (``memfit.techniques.remat`` Notes). ``budget`` (bytes or
    "11GiB"): live device bytes stay at or under it. Without one, eviction happens only when an
    allocation fails: on CUDA the allocator's out-of-memory error, on CPU an enclosing
    ``memfit.track(budget=...)``'s (enter remat inside track). ``model``: the model whose
    blocks are evictable (default: the first module called inside); ``model`` and
    ``optimizer`` also let a CPU budget count their tensors from the start. The session's ``stats``
    (``RematStats``) say what was evicted, recomputed, refused and could not be evicted; a
    budget below what eviction can reach raises ``RematBudgetTooSmall`` (a ``BudgetTooSmall``
    and a ``memfit.OutOfMemory``) with the numbers.
    """
    config = Remat.Config(budget_bytes=None if budget is None else parse_bytes(budget),
                          min_evict_bytes=min_evict_bytes, sample_size=sample_size)
    return Remat(config).session(model, optimizer)
