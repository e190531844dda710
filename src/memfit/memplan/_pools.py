"""Lifetime classes, and what separate allocator pools and expandable segments would reserve.

Note 1 (classes). By ``track``'s category: "run" (parameters, optimizer state,
buffers: alive the whole run), "step" (gradients and the batch: a step), "saved" (activations
saved for backward: forward to backward), "short" (temporaries: a few ops).

Note 2 (pools PyTorch can make). ``torch.cuda.use_mem_pool(pool)`` routes the *current
thread's* allocations to a ``MemPool``; a block returns to its own pool when freed. A
pool is chosen by when an allocation happens, not by what it is: the forward runs on the
caller's thread and can have a pool, the optimizer step too, but the backward runs on
autograd's device thread, so its allocations (gradients included) stay in the default pool
(the note on ``use_mem_pool``). The "phase-pools" scheme models that: forward -> pool F,
optimizer step -> pool O, the rest default. "optimizer-pool" keeps only the optimizer step
apart. "class-pools" routes by lifetime class (Note 1): no stock PyTorch setting does that
(a forward allocation's class, saved or temporary, is known only later); it is what a
class-aware allocator could reach, reported for comparison.

Note 3 (the replay). Every version of the log (``_lifetimes``) is malloc'd at its birth and
freed at its death, in event order, through one ``CachingAllocator`` model per pool, each
with the same ``AllocatorConfig`` (expandable segments or not: the allocator's config applies
to private pools too, modelled, unverified on a GPU); the cuBLAS workspaces are malloc'd in
the default pool before the first op, as ``trace.cuda`` does. Reserved is the sum over pools,
its peak taken over the counted step's events. Which phase an allocation of the first
(uncounted) step falls in is read from the counted step's phase starts (the two steps run the
same ops); storages alive before the trace go by category (optimizer state to pool O).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memfit.measure._ledger import CATEGORIES
from memfit.memplan._lifetimes import StorageLog, step_lifetimes
from memfit.trace.allocator import AllocatorConfig, CachingAllocator

__all__ = ["LIFETIME_CLASSES", "SCHEMES", "AllocatorOption", "AllocatorOptions",
           "allocator_options", "replay_reserved", "default_reserved", "lifetime_class",
           "workspaces"]

LIFETIME_CLASSES = ("run", "step", "saved", "short")
_CLASS_OF = {"params": "run", "optimizer": "run", "other": "run", "grads": "step",
             "inputs": "step", "activations": "saved", "temporaries": "short"}
SCHEMES = ("default", "optimizer-pool", "phase-pools", "class-pools")
APPLICABLE = ("default", "optimizer-pool", "phase-pools")      # Note 2


def lifetime_class(category: str) -> str:
    return _CLASS_OF[category]


@dataclass(frozen=True)
class AllocatorOption:
    scheme: str                   # one of SCHEMES
    expandable_segments: bool
    reserved_bytes: int           # modelled reserved peak over the counted step
    allocated_bytes: int          # modelled allocated peak (rounded blocks)
    applicable: bool              # PyTorch can set it up (Note 2)

    @property
    def name(self) -> str:
        return self.scheme + (" + expandable_segments" if self.expandable_segments else "")


@dataclass(frozen=True)
class AllocatorOptions:
    """The settings modelled on one step, the lifetime classes, and the best one to apply."""

    options: list[AllocatorOption]
    classes: dict[str, dict[str, int]]   # class -> storages, bytes, peak_live_bytes

    @property
    def default(self) -> AllocatorOption:
        return self.options[0]

    @property
    def best(self) -> AllocatorOption:
        """The applicable setting that reserves least (ties: the simpler one, listed first)."""
        return min((o for o in self.options if o.applicable), key=lambda o: o.reserved_bytes)

    @property
    def saved_bytes(self) -> int:
        return self.default.reserved_bytes - self.best.reserved_bytes

    def to_dict(self) -> dict:
        return {"options": [{"name": o.name, "scheme": o.scheme,
                             "expandable_segments": o.expandable_segments,
                             "reserved_bytes": o.reserved_bytes,
                             "allocated_bytes": o.allocated_bytes,
                             "applicable": o.applicable} for o in self.options],
                "best": self.best.name, "saved_bytes": self.saved_bytes,
                "classes": self.classes}


def _phase_of(log: StorageLog, phases: dict[str, int]) -> list[str]:
    """The phase each version was born in ("" before the forward, "entry" before the trace)."""
    starts = sorted((v, k) for k, v in phases.items() if k in ("forward", "backward", "optimizer"))
    points = np.searchsorted(log.op_events, log.birth_event, side="right")
    out = []
    for b, g in zip(log.birth_event.tolist(), points.tolist()):
        if b < 0:
            out.append("entry")
            continue
        rel = g - log.window_op if g >= log.window_op else g
        name = ""
        for start, phase in starts:
            if rel >= start:
                name = phase
        out.append(name)
    return out


def _pool_keys(log: StorageLog, scheme: str, phases: dict[str, int]) -> list[str]:
    cats = [CATEGORIES[int(c)] for c in log.category]
    if scheme == "default":
        return ["default"] * len(cats)
    if scheme == "class-pools":
        return [_CLASS_OF[c] for c in cats]
    born = _phase_of(log, phases)
    pools = {"optimizer"} if scheme == "optimizer-pool" else {"forward", "optimizer"}
    keys = []
    for phase, cat in zip(born, cats):
        if phase == "entry":
            phase = "optimizer" if cat == "optimizer" else ""
        keys.append(phase if phase in pools else "default")
    return keys


def event_order(log: StorageLog) -> list[tuple[int, int, int]]:
    """The log's births and deaths as a replay meets them: (event, 1 for a birth and 0 for a
    death, storage), a death before a birth at one event (``sorted`` of those tuples)."""
    n = len(log.birth_event)
    ids = np.arange(n, dtype=np.int64)
    dead = np.asarray(log.death_event) < log.num_events
    ev = np.concatenate([np.asarray(log.birth_event, dtype=np.int64),
                         np.asarray(log.death_event, dtype=np.int64)[dead]])
    flag = np.concatenate([np.ones(n, dtype=np.int64), np.zeros(int(dead.sum()), np.int64)])
    who = np.concatenate([ids, ids[dead]])
    idx = np.lexsort((who, flag, ev))
    return list(zip(ev[idx].tolist(), flag[idx].tolist(), who[idx].tolist()))


def replay_reserved(log: StorageLog, keys: list[str], config: AllocatorConfig,
                    workspaces: list[int] = (), order=None) -> tuple[int, int]:
    """(reserved peak, allocated peak) over the counted step, each pool its own allocator
    (Note 3); ``order``: the log's ``event_order``, where the caller replays it several times."""
    order = event_order(log) if order is None else order
    pools: dict[str, CachingAllocator] = {}
    handles: dict[int, int] = {}
    nbytes = log.nbytes.tolist()

    def pool(key: str) -> CachingAllocator:
        if key not in pools:
            pools[key] = CachingAllocator(config)
        return pools[key]

    res_peak = alloc_peak = -1
    ws_done = False
    reserved = allocated = 0
    for ev, is_birth, v in order:
        if ev >= 0 and not ws_done:
            for i, size in enumerate(workspaces):
                handles[-1 - i] = pool("default").malloc(size)
            reserved, allocated = _totals(pools)
            ws_done = True
        a = pool(keys[v])
        reserved_before, allocated_before = a.reserved_bytes, a.allocated_bytes
        if is_birth:
            handles[v] = a.malloc(nbytes[v])
        elif v in handles:
            a.free(handles.pop(v))
        reserved += a.reserved_bytes - reserved_before
        allocated += a.allocated_bytes - allocated_before
        if ev >= log.window_event:
            res_peak, alloc_peak = max(res_peak, reserved), max(alloc_peak, allocated)
    if not ws_done:
        for i, size in enumerate(workspaces):
            handles[-1 - i] = pool("default").malloc(size)
    if res_peak < 0:                 # no event in the counted step: its state throughout
        res_peak, alloc_peak = _totals(pools)
    return res_peak, alloc_peak


def _totals(pools: dict[str, CachingAllocator]) -> tuple[int, int]:
    return (sum(p.reserved_bytes for p in pools.values()),
            sum(p.allocated_bytes for p in pools.values()))


def workspaces(estimate) -> list[int]:
    """The cuBLAS workspaces a GPU estimate counts in the allocator (its CUDA model allocates
    them at the first matmul of each thread, and keeps them)."""
    if getattr(estimate, "basis", "cpu-trace") != "cuda-model":
        return []
    return [b for b in (estimate.device.cublas_workspace_bytes,
                        estimate.device.autograd_workspace_bytes) if b]


def default_reserved(estimate) -> int:
    """The caching allocator's modelled reserved peak for the estimate's step, default pool
    and settings (a CPU estimate replayed as a GPU would serve it)."""
    log, _ = step_lifetimes(estimate)
    return replay_reserved(log, ["default"] * len(log.nbytes), AllocatorConfig(),
                           workspaces(estimate))[0]


def _classes(log: StorageLog) -> dict[str, dict[str, int]]:
    life = log.window()
    names = np.asarray([_CLASS_OF[CATEGORIES[int(c)]] for c in life.category])
    out = {}
    for name in LIFETIME_CLASSES:
        sel = names == name if len(names) else np.zeros(0, dtype=bool)
        sizes = np.where(sel, life.nbytes, 0)
        out[name] = {"storages": int(sel.sum()), "bytes": int(sizes.sum()),
                     "peak_live_bytes": int(life.live_bytes(sizes).max()) if len(sizes) else 0}
    return out


def allocator_options(estimate, schemes: tuple[str, ...] = SCHEMES) -> AllocatorOptions:
    """Model every pool scheme (Note 2) with and without expandable segments on the
    estimate's step; ``.best`` is the applicable one that reserves least."""
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or "default" not in schemes:
        raise ValueError(f"schemes must include 'default' and be among {', '.join(SCHEMES)}; "
                         f"got {', '.join(schemes)}")
    log, _ = step_lifetimes(estimate)
    ws = workspaces(estimate)
    options, order = [], event_order(log)
    for scheme in ("default",) + tuple(s for s in schemes if s != "default"):
        keys = _pool_keys(log, scheme, getattr(estimate, "phases", None) or {})
        for expandable in (False, True):
            reserved, allocated = replay_reserved(
                log, keys, AllocatorConfig(expandable_segments=expandable), ws, order)
            options.append(AllocatorOption(scheme, expandable, reserved, allocated,
                                           scheme in APPLICABLE))
    return AllocatorOptions(options, _classes(log))
