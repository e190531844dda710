"""Dynamic tensor rematerialization (DTR) for eager PyTorch: evict under pressure, recompute on use.

Note 1 (granularity: one block call). The unit DTR evicts and recomputes is one forward call of
one *block* (the model's repeated layers, ``find_blocks``): all the tensors autograd saved during
that call go together, and one rerun of the block's forward brings them all back. Per-tensor DTR
(the paper's, MegEngine's) needs a Python record and a heuristic update for every aten op; in
eager PyTorch that is a Python dispatch call with closure capture per op, several times the cost
of the kernels of a small layer, paid on every step even when nothing is evicted. Per block the
bookkeeping is one wrapper call and one pack per saved tensor; the search scores at most
``sample_size`` units (a few dozen blocks per model). The price: what is saved outside blocks
(embeddings, the loss, the LM head's logits) is never evicted; ``RematStats`` counts those bytes
(``outside_blocks_bytes``), and checkpoint/offload remain the levers for them.

Note 2 (what can be freed). A block's saved tensors are packed into ``Saved`` handles that
autograd holds; eviction sets ``handle.tensor = None``. That frees the storage only when nothing
else holds it: the storage's use count (one per tensor viewing it, ``_storage_Use_Count``) must
equal the number of tensors the unit itself holds on it. Parameters, the block's own output (held
by the next block), a residual the caller still holds and views of any of them stay, and are
counted as ``held_elsewhere_bytes``. Only tensors autograd saved are ever freed: a tensor Python
code holds is never touched.

Note 3 (inputs, and the evicted neighbourhood). A unit keeps its inputs to recompute from. An
input that is the output of an earlier unit (block i-1's output is block i's input) is dropped
too, when eviction would free it, and recomputed by rerunning block i-1 first: evicted blocks
chain. As in the DTR paper, units joined by a dropped tensor form an equivalence class
(union-find); a class's cost is the forward time of its evicted members, and a candidate's cost
is its own plus that of the evicted classes it touches, because recomputing it recomputes them.

Note 4 (exactness). Recompute replays the block's forward with the CPU and device RNG states and
the autocast settings (enabled, dtype, cache) recorded when the forward ran, under grad mode,
from detached inputs with the same ``requires_grad``; the i-th tensor saved by the rerun
replaces the i-th evicted handle (a different count is an error naming the block). Dropout
draws the same masks, bf16 autocast casts the same weights: gradients are bitwise those of the
plain step. A key/value cache would be written twice (forward and recompute), so, as for
checkpoint (its Note 5), a block gets ``None`` for the arguments in ``CACHE_ARGS`` under remat.

Note 5 (in-place writes and views). A unit whose forward wrote one of its inputs in place, whose
inputs were written after its forward, or one of whose saved tensors was written after it was
saved, cannot be recomputed to the same values: it is refused (never evicted), and the reason is
logged at DEBUG on ``memfit.remat`` and kept in ``RematStats.refused``. Views need no rule:
a view shares its base's storage, which Note 2 keeps while anyone holds it.

Note 6 (when to evict). Budget ``budget_bytes``: live bytes stay at or under it. On CPU a
``memfit.track`` counter with that budget runs under remat's dispatch mode (unless an enclosing
``track`` already enforces one at least as tight); on CUDA ``set_per_process_memory_fraction``
makes the allocator refuse past it. Without a budget nothing is watched: remat evicts only when
an allocation fails (CUDA: the allocator's ``OutOfMemoryError``; CPU: an enclosing
``track(budget=...)``'s ``memfit.OutOfMemory``). Either way the failed op had no effect (track
undoes it; the allocator allocates nothing), remat evicts until the missing bytes are freed and
runs the op again. A short batch therefore evicts nothing, and a batch of another length needs
no planning. When nothing more can be evicted, ``RematBudgetTooSmall`` names the numbers.
Enter ``remat`` *inside* ``track``: the innermost dispatch mode sees each op first, and remat's
must be above the counter whose error it catches.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import flop_registry

from memfit.errors import BudgetTooSmall, OutOfMemory
from memfit.measure import Tracker, find_blocks
from memfit.measure._counting import CountingMode
from memfit.techniques._remat_units import Unit
from memfit.techniques.checkpoint import CACHE_ARGS
from memfit.units import format_bytes

__all__ = ["Remat", "RematSession", "RematStats", "RematBudgetTooSmall"]

log = logging.getLogger("memfit.remat")


class RematBudgetTooSmall(BudgetTooSmall, OutOfMemory):
    """Nothing more can be evicted and the op still does not fit (Note 6). ``floor_bytes``: the
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
    evicted_bytes: int = 0            # bytes those evictions freed (Note 2's count)
    recomputes: int = 0               # units recomputed (a chain counts each member)
    recompute_seconds: float = 0.0
    recompute_flops: int = 0          # FLOPs the recomputes ran (torch's FLOP formulas)
    retries: int = 0                  # ops run again after an eviction
    too_small: int = 0                # candidates skipped: would free < min_evict_bytes
    held_elsewhere_bytes: int = 0     # max seen: saved by a block but held elsewhere (Note 2)
    outside_blocks_bytes: int = 0     # saved by autograd outside every block (Note 1)
    refused: dict[str, str] = field(default_factory=dict)   # block -> why never evicted (Note 5)


class _PressureMode(TorchDispatchMode):
    """Runs each op; on an out-of-memory error, evicts and runs it again (Note 6)."""

    def __init__(self, session: "RematSession"):
        super().__init__()
        self.session = session

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.session
        s.clock += 1
        while True:
            try:
                out = func(*args, **kwargs)
                counter = flop_registry.get(func._overloadpacket)
                if counter is not None:
                    s.flops += int(counter(*args, **kwargs, out_val=out))
                return out
            except torch.OutOfMemoryError as e:
                if isinstance(e, RematBudgetTooSmall) or not self.session.make_room(e):
                    if isinstance(e, RematBudgetTooSmall):
                        raise
                    raise self.session.too_small(e, func) from e
                self.session.stats.retries += 1


class _RematForward:
    """The instance ``forward`` of a block under remat: one ``Unit`` per call (Note 1)."""

    def __init__(self, session: "RematSession", name: str, original, keep_cache: bool):
        self.session, self.name, self.original = session, name, original
        params = inspect.signature(original).parameters
        positional = [n for n, p in params.items() if p.kind in
                      (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self._cache_args = () if keep_cache else tuple(   # (name, position or None), Note 4
            (n, positional.index(n) if n in positional else None) for n in CACHE_ARGS
            if n in params or any(p.kind is p.VAR_KEYWORD for p in params.values()))

    def __call__(self, *args, **kwargs):
        s = self.session
        if not torch.is_grad_enabled() or not s.open or torch._C._current_graph_task_id() != -1:
            return self.original(*args, **kwargs)
        args, kwargs = list(args), dict(kwargs)
        for name, pos in self._cache_args:
            if kwargs.get(name) is not None:
                kwargs[name] = None
            if pos is not None and pos < len(args):
                args[pos] = None
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        unit = Unit(s, self.name, self.original, args, kwargs, outer)
        s.admit(unit)
        unit.busy = True
        start = s.flops
        try:
            with torch.autograd.graph.saved_tensors_hooks(unit.pack, unit.unpack):
                out = self.original(*args, **kwargs)
        finally:
            unit.busy = False
        unit.finish(out, s.flops - start)
        s.produced(unit)
        return out


class RematSession:
    """``with`` block in which blocks of the model are evictable (see the module Notes)."""

    def __init__(self, config: "Remat.Config", model: nn.Module | None = None):
        self.config = config
        self.model = model
        self.stats = RematStats()
        self.units: list[Unit] = []
        self.active: Unit | None = None        # the unit backward is in (not a candidate)
        self.open = False
        self.clock = 0                         # ops run so far (staleness is counted in ops)
        self.flops = 0                         # FLOPs run so far (cost is counted in FLOPs)
        self._rng = random.Random(config.seed)
        self._parent: dict[int, int] = {}      # union-find over unit ids (Note 3)
        self._class_cost: dict[int, int] = {}
        self._by_id: dict[int, Unit] = {}
        self._outputs: dict[int, tuple] = {}   # id(output tensor) -> (weakref, unit, index)
        self._wrapped: list[tuple[nn.Module, object]] = []
        self._roots: set[int] = set()
        self._depth = 0
        self._nested = 0                       # rematerialize calls in progress (chains)
        self._outside: set[int] = set()
        self._stack = contextlib.ExitStack()

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> "RematSession":
        s = self._stack
        try:
            budget = self.config.budget_bytes
            device = self._device()
            if budget is not None and device == "cuda":
                s.enter_context(_cuda_fraction(budget))
            elif budget is not None and not _enclosing_budget_at_most(budget):
                s.enter_context(Tracker(model=self.model, budget=budget, device=device))
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            s.enter_context(torch.autograd.graph.saved_tensors_hooks(
                lambda x: self._pack_outside(x, outer),
                (lambda y: outer[1](y)) if outer is not None else _identity))
            s.enter_context(_PressureMode(self))
            if self.model is not None:
                self._wrap(self.model)
            else:
                s.callback(torch.nn.modules.module.register_module_forward_pre_hook(
                    self._pre).remove)
                s.callback(torch.nn.modules.module.register_module_forward_hook(
                    self._post, always_call=True).remove)
            s.callback(self._close)
        except BaseException:
            s.close()
            raise
        self.open = True
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False

    def _close(self) -> None:
        self.open = False
        for block, previous in reversed(self._wrapped):
            vars(block).pop("forward", None)
            if previous is not None:
                vars(block)["forward"] = previous
        self._wrapped = []

    def _device(self) -> str:
        if self.model is not None:
            for p in self.model.parameters():
                return p.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _pre(self, module, args) -> None:
        """Global pre-hook (no model given): the first module called at depth 0 is a root."""
        if self._depth == 0 and id(module) not in self._roots:
            self._roots.add(id(module))
            self._wrap(module)
        self._depth += 1

    def _post(self, module, args, out) -> None:
        self._depth -= 1

    def _wrap(self, model: nn.Module) -> None:
        names = self.config.blocks or tuple(find_blocks(model))
        if not names:
            log.warning("remat: %s has no repeated blocks, so nothing can be evicted (remat "
                        "Note 1); pass Remat.Config(blocks=(...)) to name them",
                        type(model).__name__)
        for name in names:
            block = model.get_submodule(name)
            if isinstance(vars(block).get("forward"), _RematForward):
                continue
            previous = vars(block).get("forward")
            vars(block)["forward"] = _RematForward(
                self, name, block.forward, getattr(block, "_can_checkpoint_with_cache", False))
            self._wrapped.append((block, previous))

    def _pack_outside(self, x, outer):
        """Saved outside every block: never evicted; counted once per storage (Note 1)."""
        y = outer[0](x) if outer is not None else x
        if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) and x.layout is torch.strided:
            st = x.untyped_storage()
            if st._cdata not in self._outside:
                self._outside.add(st._cdata)
                self.stats.outside_blocks_bytes += st.nbytes()
        return y

    # -- units ------------------------------------------------------------------------------
    def admit(self, unit: Unit) -> None:
        self.units.append(unit)
        self._by_id[id(unit)] = unit
        self.stats.units += 1
        for i, x in enumerate(unit.flat):
            if isinstance(x, torch.Tensor):
                entry = self._outputs.get(id(x))
                if entry is not None and entry[0]() is x and entry[1].flat:
                    unit.producers[i] = (entry[1], entry[2])

    def produced(self, unit: Unit) -> None:
        for k, ref in enumerate(unit.outputs):
            t = ref()
            if t is not None:
                self._outputs[id(t)] = (ref, unit, k)
        if unit.refused and unit.name not in self.stats.refused:
            self.stats.refused[unit.name] = unit.refused
            log.debug("remat: block %s refused: %s", unit.name, unit.refused)

    def retire(self, unit: Unit) -> None:
        if unit in self.units:
            self.units.remove(unit)
        if self.active is unit:
            self.active = None
        for k, ref in enumerate(unit.outputs):
            t = ref()
            if t is not None and self._outputs.get(id(t), (None, None))[1] is unit:
                del self._outputs[id(t)]

    # -- eviction ---------------------------------------------------------------------------
    def make_room(self, e: torch.OutOfMemoryError) -> int:
        """Evict until the bytes ``e`` misses are freed (one unit when unknown); bytes freed."""
        need = None
        if isinstance(e, OutOfMemory):
            need = e.live_bytes + e.requested_bytes - e.budget_bytes
        freed = 0
        while need is None and freed == 0 or need is not None and freed < need:
            best = self._choose()
            if best is None:
                break
            unit, nbytes = best
            self._evict(unit)
            freed += nbytes
        return freed

    def _choose(self) -> tuple[Unit, int] | None:
        """The candidate with the least cost / (bytes x staleness) (Notes 2, 3)."""
        cands = [u for u in self.units if not u.evicted and not u.busy and u is not self.active
                 and u.flat]
        k = self.config.sample_size
        if k and len(cands) > k:
            cands = self._rng.sample(cands, k)
        now = self.clock
        best, best_h = None, None
        for u in cands:
            reason = u.check_recomputable()
            if reason:
                if u.name not in self.stats.refused:
                    self.stats.refused[u.name] = reason
                    log.debug("remat: block %s refused: %s", u.name, reason)
                continue
            free, held = u.freeable(also=[t for _, _, t in self._consumer_inputs(u)])
            self.stats.held_elsewhere_bytes = max(self.stats.held_elsewhere_bytes, held)
            if free < max(1, self.config.min_evict_bytes):
                self.stats.too_small += 1
                continue
            h = (u.cost_flops + self._neighbourhood_cost(u) + 1) / (free * max(now - u.last, 1))
            if best_h is None or h < best_h:
                best, best_h = (u, free), h
        return best

    def _consumer_inputs(self, unit: Unit) -> list[tuple[Unit, int, torch.Tensor]]:
        """(consumer, slot, tensor): inputs ``unit`` made for units already evicted (Note 3)."""
        return [(c, i, c.flat[i]) for c in self.units if c.evicted and c.flat
                for i in c.inputs_from(unit)]

    def _evict(self, unit: Unit) -> None:
        consumers = self._consumer_inputs(unit)
        free, _ = unit.freeable(also=[t for _, _, t in consumers])
        for producer, _k in unit.droppable_inputs().values():
            self._union(unit, producer)
        unit.evict()
        for consumer, slot, _t in consumers:
            consumer.drop_input(slot)
            self._union(unit, consumer)
        root = self._find(id(unit))
        self._class_cost[root] = self._class_cost.get(root, 0) + unit.cost_flops
        self.stats.evictions += 1
        self.stats.evicted_bytes += free
        log.debug("remat: evicted %s (%d B)", unit.name, free)

    def rematerialize(self, unit: Unit, need_outputs: bool = False):
        """Recompute ``unit`` (and, first, the producers of its dropped inputs)."""
        was_evicted = unit.evicted
        unit.busy = True
        start, flops = time.perf_counter(), self.flops
        self._nested += 1
        try:
            outs = unit.recompute()
        finally:
            unit.busy = False
            self._nested -= 1
        self.stats.recomputes += 1
        if self._nested == 0:        # a chain's producers ran inside: count the chain once
            self.stats.recompute_seconds += time.perf_counter() - start
            self.stats.recompute_flops += self.flops - flops
        if was_evicted:
            root = self._find(id(unit))
            self._class_cost[root] = max(0, self._class_cost.get(root, 0) - unit.cost_flops)
        return outs

    def _neighbourhood_cost(self, unit: Unit) -> float:
        roots = {self._find(id(unit))}
        roots |= {self._find(id(p)) for p, _ in unit.droppable_inputs().values()}
        roots |= {self._find(id(c)) for c, _, _ in self._consumer_inputs(unit)}
        return sum(self._class_cost.get(r, 0) for r in roots)

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


def _identity(x):
    return x


def _enclosing_budget_at_most(budget: int) -> bool:
    """An active ``track`` already enforces a budget at least as tight (Note 6)."""
    for mode in _get_current_dispatch_mode_stack():
        if isinstance(mode, CountingMode) and mode.t.budget_bytes is not None \
                and mode.t.budget_bytes <= budget:
            return True
    return False


@contextlib.contextmanager
def _cuda_fraction(budget: int):
    """The CUDA allocator refuses past ``budget`` bytes (Note 6)."""
    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).total_memory
    before = torch.cuda.get_per_process_memory_fraction(dev)
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), dev)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, dev)


class Remat:
    """Dynamic tensor rematerialization: ``with Remat(Remat.Config(...)).session(model):``."""

    @dataclass(frozen=True)
    class Config:
        # live device bytes stay at or under this; None: evict only when an allocation fails
        budget_bytes: int | None = None
        # a unit whose eviction would free fewer bytes is not evicted (not worth a recompute)
        min_evict_bytes: int = 4096
        # units scored per eviction (a random sample when there are more); 0: score all
        sample_size: int = 16
        # qualified names of the modules that are units; None: the model's blocks
        blocks: tuple[str, ...] | None = None
        seed: int = 0                # of the candidate sampler (Python's random, not torch's)

        def __post_init__(self):
            b = self.budget_bytes
            if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b <= 0):
                raise ValueError(f"Remat.Config.budget_bytes={b!r} must be a positive int "
                                 "(bytes) or None (evict only when an allocation fails)")
            for name in ("min_evict_bytes", "sample_size", "seed"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ValueError(f"Remat.Config.{name}={v!r} must be an int >= 0")
            if self.blocks is not None and not (isinstance(self.blocks, tuple) and self.blocks
                                                and all(isinstance(n, str) for n in self.blocks)):
                raise ValueError(f"Remat.Config.blocks={self.blocks!r} must be a non-empty "
                                 "tuple of module names, or None for the model's blocks")

    def __init__(self, config: "Remat.Config"):
        self.config = config

    def session(self, model: nn.Module | None = None) -> RematSession:
        """A context manager; without ``model`` the first module called inside is the model."""
        return RematSession(self.config, model)
