"""The DTR heuristic of ``memfit.techniques.remat``: which unit to evict, and the error when none.

The candidate of least h = cost / (bytes freed x staleness) is evicted: cost in forward FLOPs of
the unit and of the evicted classes it joins (units linked by a dropped input form a union-find
class, as in the DTR paper), bytes only those the unit alone holds, staleness in aten ops since
its last use; at most ``sample_size`` seeded candidates are scored (docs/techniques/dtr.md).
``Eviction`` is the part of ``RematSession`` that chooses: it reads the session's ``units``,
``active``, ``clock``, ``config`` and ``stats``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import torch

from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit.errors import BudgetTooSmall, OutOfMemory
from memfit.techniques._remat_units import Unit
from memfit.units import format_bytes

__all__ = ["Eviction", "RematBudgetTooSmall", "RematStats", "new_bytes"]

log = logging.getLogger("memfit.remat")


class RematBudgetTooSmall(BudgetTooSmall, OutOfMemory):
    """Nothing more can be evicted and the op still does not fit the budget. ``floor_bytes``: the
    least budget this op needed with everything evictable gone (live + requested)."""

    def __init__(self, message: str, *, floor_bytes: int, budget_bytes: int, live_bytes: int,
                 requested_bytes: int, op: str, module: str | None):
        Exception.__init__(self, message)
        self.floor_bytes, self.budget_bytes = floor_bytes, budget_bytes
        self.live_bytes, self.requested_bytes = live_bytes, requested_bytes
        self.op, self.module = op, module


@dataclass
class RematStats:
    """What one remat session did. Bytes are storage bytes, seconds wall time."""

    units: int = 0                    # block calls recorded
    evictions: int = 0                # units evicted
    evicted_bytes: int = 0            # bytes those evictions freed (storages freed only)
    recomputes: int = 0               # units recomputed (a chain counts each member)
    recompute_seconds: float = 0.0
    recompute_flops: int = 0          # FLOPs the recomputes ran (torch's FLOP formulas)
    retries: int = 0                  # ops run again after an eviction
    ahead: int = 0                    # ops before which remat evicted, their outputs' bytes
                                      # known in advance from the meta kernel (CPU)
    max_retried_bytes: int = 0        # the largest allocation refused (and retried): on CPU the
                                      # op ran before track refused and undid it
    too_small: int = 0                # candidates skipped: would free < min_evict_bytes
    held_elsewhere_bytes: int = 0     # max seen: saved by a block but held elsewhere too
    outside_blocks_bytes: int = 0     # saved by autograd outside every block, over the session
                                      # (each storage once): never evictable (units are blocks)
    refused: dict[str, str] = field(default_factory=dict)   # block -> why never evicted


class Eviction:
    """Candidate choice by cost / (bytes x staleness), union-find classes (module docstring)."""

    def _init_eviction(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._parent: dict[int, int] = {}      # union-find over unit ids (never split)
        self._class_cost: dict[int, int] = {}  # root -> forward FLOPs of its evicted members

    def make_room(self, e: torch.OutOfMemoryError) -> int:
        """Evict until the bytes ``e`` misses are freed (one candidate when unknown); bytes
        freed."""
        need = None
        if isinstance(e, OutOfMemory):
            need = e.live_bytes + e.requested_bytes - e.budget_bytes
            self.stats.max_retried_bytes = max(self.stats.max_retried_bytes, e.requested_bytes)
        return self.free(need)

    def free(self, need: int | None) -> int:
        """Evict until ``need`` bytes are freed (one candidate when None); bytes freed."""
        freed = 0
        while need is None and freed == 0 or need is not None and freed < need:
            best = self._choose()
            if best is None:
                break
            unit, inputs, nbytes = best
            self._evict(unit, inputs)
            freed += nbytes
        return freed

    def _choose(self) -> tuple[Unit, bool, int] | None:
        """The candidate of least cost / (bytes x staleness): a unit's saved
        tensors, or (``inputs``) the inputs of an evicted unit whose producer is evicted."""
        cands = [u for u in self.units if not u.busy and u is not self.active and u.flat and
                 (not u.evicted or u.droppable_inputs())]
        k = self.config.sample_size
        if k and len(cands) > k:
            cands = self._rng.sample(cands, k)
        best, best_h = None, None
        for u in cands:
            reason = u.check_recomputable()
            if reason:
                if u.name not in self.stats.refused:
                    self.stats.refused[u.name] = reason
                    log.debug("remat: block %s refused: %s", u.name, reason)
                continue
            inputs = u.evicted
            free, held = u.freeable(inputs)
            if not inputs:
                self.stats.held_elsewhere_bytes = max(self.stats.held_elsewhere_bytes, held)
            if free < max(1, self.config.min_evict_bytes):
                self.stats.too_small += 1
                continue
            h = (self._cost(u, inputs) + 1) / (free * max(self.clock - u.last, 1))
            if best_h is None or h < best_h:
                best, best_h = (u, inputs, free), h
        return best

    def _cost(self, unit: Unit, inputs: bool) -> int:
        """What evicting would make a recompute of ``unit`` cost: its forward, plus the evicted
        classes it is or would be joined to."""
        roots = {self._find(id(unit))}
        if inputs:
            roots |= {self._find(id(p)) for p, _ in unit.droppable_inputs().values()}
        cost = sum(self._class_cost.get(r, 0) for r in roots)
        return cost if unit.evicted else cost + unit.cost_flops

    def _evict(self, unit: Unit, inputs: bool) -> None:
        free, _ = unit.freeable(inputs)
        if inputs:
            for producer in unit.drop_inputs():
                self._union(unit, producer)
        else:
            unit.evict()
            root = self._find(id(unit))
            self._class_cost[root] = self._class_cost.get(root, 0) + unit.cost_flops
            self.stats.evictions += 1
        self.stats.evicted_bytes += free
        log.debug("remat: evicted %s %s (%d B)", unit.name, "inputs" if inputs else "saved", free)

    def _find(self, i: int) -> int:
        parent = self._parent
        while parent.get(i, i) != i:
            parent[i] = parent.get(parent[i], parent[i])
            i = parent[i]
        return i

    def _union(self, a: Unit, b: Unit) -> None:
        ra, rb = self._find(id(a)), self._find(id(b))
        if ra != rb:
            self._parent[ra] = rb
            self._class_cost[rb] = self._class_cost.get(rb, 0) + self._class_cost.pop(ra, 0)

    def too_small(self, e: torch.OutOfMemoryError, func) -> RematBudgetTooSmall:
        budget = self.config.budget_bytes
        if isinstance(e, OutOfMemory):
            live, req, budget, module = e.live_bytes, e.requested_bytes, e.budget_bytes, e.module
        else:                                  # the CUDA allocator's own error
            live, req, module = torch.cuda.memory_allocated(), 0, None
            budget = budget if budget is not None else torch.cuda.get_device_properties(0).total_memory
        floor = live + req
        st = self.stats
        refused = "; ".join(f"{n}: {r}" for n, r in list(st.refused.items())[:3])
        msg = (f"remat: budget {format_bytes(budget)} ({budget} B) is below what eviction can "
               f"reach: at {func} {format_bytes(live)} ({live} B) are live and the op needs "
               f"{format_bytes(req)} ({req} B) more, with nothing left to evict ({st.evictions} "
               f"block calls evicted, {format_bytes(st.evicted_bytes)} freed; "
               f"{format_bytes(st.outside_blocks_bytes)} saved outside any block and "
               f"{format_bytes(st.held_elsewhere_bytes)} saved by a block but held elsewhere "
               "cannot be evicted" + (f"; refused: {refused}" if refused else "") + "). "
               f"This op needs a budget of at least {format_bytes(floor)} ({floor} B): raise "
               "the budget, or shrink what stays live with checkpoint='all', offload='all', "
               "offload_optimizer=True, or a smaller micro_batch_size.")
        return RematBudgetTooSmall(msg, floor_bytes=floor, budget_bytes=budget, live_bytes=live,
                                   requested_bytes=req, op=str(func), module=module)

    def _recomputed(self, unit: Unit) -> None:
        """An evicted unit is back: its class owes its cost no more (the paper's approximation:
        classes are not split)."""
        root = self._find(id(unit))
        self._class_cost[root] = max(0, self._class_cost.get(root, 0) - unit.cost_flops)



def new_bytes(func, args, kwargs) -> int | None:
    """Bytes of the new storages ``func`` would return, from its meta kernel run on meta
    stand-ins of its inputs (so remat evicts before an op a CPU counter would refuse only after
    it ran); None when that cannot tell (no meta kernel, a
    data-dependent shape, a tensor subclass)."""
    returns = func._schema.returns
    if all(r.alias_info is not None for r in returns):     # views, in-place, nothing
        return 0
    flat, spec = tree_flatten((args, kwargs))
    with _disable_current_modes():
        meta = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                if type(x) not in (torch.Tensor, nn.Parameter):
                    return None
                x = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            elif isinstance(x, torch.device):
                x = torch.device("meta")
            meta.append(x)
        margs, mkwargs = tree_unflatten(meta, spec)
        try:
            out = func(*margs, **mkwargs)
        except (NotImplementedError, RuntimeError):      # no meta kernel / data-dependent
            return None
    outs = out if len(returns) > 1 else (out,)
    total = 0
    for r, o in zip(returns, outs):
        if r.alias_info is None:
            total += sum(t.untyped_storage().nbytes() for t in tree_flatten(o)[0]
                         if isinstance(t, torch.Tensor))
    return total
