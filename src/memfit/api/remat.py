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
    exactly when backward needs them (docs/techniques/dtr.md). ``budget`` (bytes or
    "11GiB"): live device bytes stay at or under it. Without one, eviction happens only when an
    allocation fails: on CUDA the allocator's out-of-memory error, on CPU an enclosing
    ``memfit.track(budget=...)``'s (enter remat inside track). A CPU budget counts every tensor
    alive when the session opens (parameters, gradients, optimizer state, the batch, anything
    else), and everything born inside, such as the state the first ``optimizer.step`` creates.
    ``model``: the model whose blocks are evictable (default: the outermost module whose
    forward runs first inside; its blocks are found as ``find_blocks`` finds them);
    ``optimizer`` sorts the counted bytes into categories. Nothing is assigned on the user's
    modules (module hooks), and the session keeps neither alive after it exits. The session's
    ``stats`` (``RematStats``) say what was evicted, recomputed, refused and could not be evicted; a
    budget below what eviction can reach raises ``RematBudgetTooSmall`` (a ``BudgetTooSmall``
    and a ``memfit.OutOfMemory``) with the numbers.
    """
    config = Remat.Config(budget_bytes=None if budget is None else parse_bytes(budget),
                          min_evict_bytes=min_evict_bytes, sample_size=sample_size)
    return Remat(config).session(model, optimizer)
