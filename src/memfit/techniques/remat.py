"""Dynamic tensor rematerialization (DTR) for eager PyTorch: evict under pressure, recompute on use.

Note 1 (granularity: one block call). The unit DTR evicts and recomputes is one forward call of
one *block* (the model's repeated layers, ``find_blocks``): all the tensors autograd saved during
that call go together, and one rerun of the block's forward brings them all back. Per-tensor DTR
(the paper's, MegEngine's) needs a Python record and a heuristic update for every aten op; in
eager PyTorch that is a Python dispatch call with closure capture per op, several times the cost
of the kernels of a small layer, paid on every step even when nothing is evicted. Per block the
bookkeeping is two module hooks per call (Note 7) and one pack per saved tensor; the search
scores at most ``sample_size`` units (a few dozen blocks per model). The price: what is saved outside blocks
(embeddings, the loss, the LM head's logits) is never evicted; ``RematStats`` counts those bytes
(``outside_blocks_bytes``), and checkpoint/offload remain the levers for them.

Note 2 (what can be freed). A block's saved tensors are packed into ``Saved`` handles that
autograd holds; eviction sets ``handle.tensor = None``. That frees the storage only when nothing
else holds it: the storage's use count (one per tensor viewing it, ``_storage_Use_Count``) must
equal the number of tensors the unit itself holds on it. Parameters, the block's own output (held
by the next block), a residual the caller still holds and views of any of them stay, and are
counted as ``held_elsewhere_bytes``. Only tensors autograd saved are ever freed: a tensor Python
code holds is never touched.

Note 3 (inputs, and the evicted neighbourhood). A unit keeps its inputs to recompute from, so
evicting it drops its saved tensors only (a checkpoint's view). An input that is the output of
an earlier unit which is itself evicted (block i-1's output is block i's input) is a candidate of
its own: dropping it frees its bytes, and a recompute of block i then reruns block i-1 first to
get it back, refilling i-1 as well (backward needs it next; under pressure it is evicted again).
A producer that is not evicted never loses its output this way: rerunning it would cost a whole
block for one tensor. As in the DTR paper, units joined by a dropped tensor form an equivalence
class (union-find, never split: the paper's approximation); a class's cost is the forward FLOPs
of its evicted members, and a candidate's cost is its own forward (if it is not evicted yet)
plus the classes evicting it joins: so a small input whose loss chains many evicted blocks goes
last, as the paper's heuristic has it. The heuristic is h = cost / (bytes freed x staleness), cost in
forward FLOPs (torch's formulas, counted by remat's dispatch mode as the forward runs) and
staleness in aten ops since the unit was last used: both are deterministic, so one budget
gives the same evictions on every run. At most ``sample_size`` candidates (a seeded sample) are
scored per eviction, and a unit that would free under ``min_evict_bytes`` is skipped.

Note 4 (exactness). Recompute replays the block's forward with the CPU and device RNG states and the
autocast settings (enabled, dtype, cache) recorded when the forward ran, under grad mode, from
detached inputs with the same ``requires_grad``; the i-th tensor saved by the rerun replaces the
i-th evicted handle (a different count is an error naming the block). Dropout draws the same masks,
bf16 autocast casts the same weights: gradients are bitwise those of the plain step. A key/value
cache would be written twice (forward and recompute), so, as under ``memfit.techniques.checkpoint``,
a block gets ``None`` for the arguments in ``CACHE_ARGS`` under remat.

Note 5 (in-place writes and views). A unit whose forward wrote one of its inputs in place, whose
inputs were written after its forward, or one of whose saved tensors was written after it was
saved, cannot be recomputed to the same values: it is refused (never evicted), and the reason is
logged at DEBUG on ``memfit.remat`` and kept in ``RematStats.refused``. Views need no rule:
a view shares its base's storage, which Note 2 keeps while anyone holds it.

Note 6 (when to evict). Budget ``budget_bytes``: live bytes stay at or under it. On CPU a
``memfit.track`` counter with that budget runs under remat's dispatch mode, and counts from the
start everything alive when the session opens (Note 8), whatever the session was told (an
enclosing ``track(budget=...)`` is not relied on: without a model it counts tensors from
their first use). On CUDA
``set_per_process_memory_fraction`` makes the allocator refuse past it (it knows every byte).
Without a budget nothing is watched: remat evicts only when an allocation fails (CUDA: the
allocator's ``OutOfMemoryError``; CPU: an enclosing ``track(budget=...)``'s
``memfit.OutOfMemory``). Either way the failed op had no effect (track undoes it; the allocator
allocates nothing), remat evicts until the missing bytes are freed and runs the op again. On
CPU, where track can refuse an op only after it ran (its outputs existed for an instant),
remat evicts *before* an op whose new storages would pass a budgeted counter below it: their
bytes come from the op's meta kernel run on meta stand-ins of its inputs (``new_bytes``; an
op with no meta kernel or a data-dependent shape falls back to the refusal). So live bytes
stay under the budget at every instant an op allocates, not only at op boundaries. A
short batch therefore evicts nothing, and a batch of another length needs no planning. When
nothing more can be evicted, ``RematBudgetTooSmall`` names the numbers (raised from forward or
backward, before the optimizer step, so parameters and optimizer state are as they were; or on
entry, when what is already alive passes the budget). Optimizer state the first
``optimizer.step`` creates inside the session is counted as it is born, like any op's output.
Enter ``remat`` *inside* ``track``: the innermost dispatch mode sees each op first, and remat's
must be above the counter whose error it catches.

Note 7 (extension points, not patches). A block becomes evictable through two hooks of its
own: a forward pre-hook (``with_kwargs``) that opens the unit, nulls the cache arguments (Note
4) and pushes the unit's ``saved_tensors_hooks``, and a forward hook (``always_call``, so a
forward that raises still pops them; ``prepend``, so the unit spans exactly the block's
``forward``) that closes it. A recompute calls the block's own ``forward`` (hooks are not part
of it, and the pack hooks were not around them). Nothing is assigned on the user's modules.
Without ``model``, one global forward pre-hook waits for the model: the first module whose
forward runs with grad enabled outside backward (the outermost module of the user's first
call), whose blocks are then found by ``find_blocks`` and hooked; the global hook is then
removed, so a recompute's submodule calls (inside backward) and later calls find nothing. The
saved-tensor hooks in force when the session opened (e.g. ``track``'s) are what a unit's pack
delegates to; remat's own outside-block counter never sees a block's tensors.

Note 8 (what is alive on entry). A budget counts every byte on the device, so the session's
counter starts with every storage alive when it opens: every tensor object Python can reach
(the garbage collector tracks each one: parameters, buffers, optimizer state, the batch, other
models), each leaf's ``.grad``, and as host memory (not under the budget) the tensors of any
object with a ``host_tensors()`` method (memfit's offloaded optimizer). Fake and meta tensors
hold no bytes and are skipped. Cyclic garbage is collected first (``gc.collect()``): a failed
step's traceback cycles hold real bytes that nothing can reach. One collection and one walk of
the gc's objects per session (about 0.2 s per 400k Python objects). What it cannot see:
storages held only from C++ with no Python object (an autograd graph built before the
session), counted from their first use by an op.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memfit.measure import Tracker, find_blocks
from memfit.measure._counting import CountingMode
from memfit.techniques._protocol import Change
from memfit.techniques._remat_budget import count_live_storages, cuda_fraction
from memfit.techniques._remat_evict import Eviction, RematBudgetTooSmall, RematStats, new_bytes
from memfit.techniques._remat_hooks import BlockHooks, PressureMode
from memfit.techniques._remat_units import Unit
from memfit.units import format_bytes

__all__ = ["Remat", "RematSession", "RematStats", "RematBudgetTooSmall"]

log = logging.getLogger("memfit.remat")
_NOTE = ("remat: blocks' saved tensors are evicted under memory pressure and recomputed when "
         "backward needs them (DTR)")


class RematSession(Eviction):
    """``with`` block in which blocks of the model are evictable (see the module Notes)."""

    def __init__(self, config: "Remat.Config", model: nn.Module | None = None, optimizer=None):
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.stats = RematStats()
        self.units: list[Unit] = []
        self.active: Unit | None = None        # the unit backward is in (not a candidate)
        self.open = False
        self.clock = 0                         # ops run so far (staleness is counted in ops)
        self.flops = 0                         # FLOPs run so far (cost is counted in FLOPs)
        self._init_eviction(config.seed)
        self._outputs: dict[int, tuple] = {}   # id(output tensor) -> (weakref, unit, index)
        self._blocks: list[BlockHooks] = []
        self._find_handle = None               # the global pre-hook that finds the model
        self._nested = 0                       # rematerialize calls in progress (chains)
        self._outside: set[int] = set()
        self._below = None                     # saved-tensor hooks found on entry (or None)
        self.watched: list[tuple] = []         # (ledger, budget) of the CPU counters below
        self._stack = contextlib.ExitStack()

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> "RematSession":
        s = self._stack
        try:
            budget = self.config.budget_bytes
            device = self._device()
            if budget is not None and device == "cuda":
                s.enter_context(cuda_fraction(budget))
            elif budget is not None:
                tracker = s.enter_context(Tracker(model=self.model, optimizer=self.optimizer,
                                                  budget=budget, device=device))
                count_live_storages(tracker)
                if tracker.ledger.current_bytes > budget:
                    raise self.over_at_entry(tracker.ledger.current_bytes, budget)
            if device == "cpu":
                self.watched = [(m.t.ledger, m.t.budget_bytes)
                                for m in _get_current_dispatch_mode_stack()
                                if isinstance(m, CountingMode) and m.t.budget_bytes is not None]
            self._below = torch._C._autograd._top_saved_tensors_default_hooks(False)
            s.enter_context(torch.autograd.graph.saved_tensors_hooks(
                self._pack_outside, self._unpack_outside))
            s.enter_context(PressureMode(self))
            s.callback(self._close)
            if self.model is not None:
                self._hook_blocks(self.model)
            else:
                self._find_handle = torch.nn.modules.module.register_module_forward_pre_hook(
                    self._find_model)
        except BaseException:
            s.close()
            raise
        self.open = True
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False

    def evict_ahead(self, func, args, kwargs) -> None:
        """Before ``func`` runs, evict what its outputs would put past a CPU budget (Note 6)."""
        over = [ledger.current_bytes - budget for ledger, budget in self.watched]
        if max(over) < 0 and not any(u.flat for u in self.units):
            return                       # nothing to evict: let the counter decide
        nbytes = new_bytes(func, args, kwargs)
        need = max(over) + (nbytes or 0)
        if nbytes and need > 0 and self.free(need):
            self.stats.ahead += 1

    def over_at_entry(self, live: int, budget: int) -> RematBudgetTooSmall:
        return RematBudgetTooSmall(
            f"remat: budget {format_bytes(budget)} ({budget} B) is below what is already alive "
            f"when the session opens: {format_bytes(live)} ({live} B) of tensors on the "
            "device (parameters, gradients, optimizer state, the batch and any other live "
            "tensor; remat Note 8), none of which remat can evict. Raise the budget to well "
            "above that, or free what the step does not need before entering remat.",
            floor_bytes=live, budget_bytes=budget, live_bytes=live, requested_bytes=0,
            op="(session entry)", module=None)

    def _close(self) -> None:
        self.open = False
        if self._find_handle is not None:
            self._find_handle.remove()
            self._find_handle = None
        for hooks in reversed(self._blocks):
            hooks.close()
        self._blocks = []
        # what the session was given or found stays the user's alone (nothing kept alive)
        self.model = self.optimizer = self.active = None
        self.watched = []
        self.units, self._outputs = [], {}

    def _device(self) -> str:
        """Whose bytes the budget caps: the model's device, else CUDA where there is one."""
        if self.model is not None:
            for p in self.model.parameters():
                return p.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _find_model(self, module: nn.Module, args) -> None:
        """Global pre-hook (no model given): the first module to run a forward with grad
        enabled, outside backward, is the model (Note 7); then this hook goes."""
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1 \
                or self._find_handle is None:
            return
        self._find_handle.remove()
        self._find_handle = None
        self.model = module
        self._hook_blocks(module)

    def _hook_blocks(self, model: nn.Module) -> None:
        names = self.config.blocks or tuple(find_blocks(model))
        if not names:
            log.warning("remat: %s has no repeated blocks, so nothing can be evicted (remat "
                        "Note 1); pass Remat.Config(blocks=(...)) to name them",
                        type(model).__name__)
        for name in names:
            self._blocks.append(BlockHooks(self, name, model.get_submodule(name)))

    def outer_hooks(self):
        """The saved-tensor hooks a block's pack and unpack delegate to: those in force, or,
        where they are this session's own (outside every block), those found on entry."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and top[0] == self._pack_outside:
            return self._below
        return top

    def _pack_outside(self, x):
        """Saved outside every block: never evicted; counted once per storage (Note 1)."""
        y = self._below[0](x) if self._below is not None else x
        if isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter) and x.layout is torch.strided:
            st = x.untyped_storage()
            if st._cdata not in self._outside:
                self._outside.add(st._cdata)
                self.stats.outside_blocks_bytes += st.nbytes()
        return y

    def _unpack_outside(self, y):
        return self._below[1](y) if self._below is not None else y

    # -- units ------------------------------------------------------------------------------
    def admit(self, unit: Unit) -> None:
        self.units.append(unit)
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
            self._recomputed(unit)
        return outs

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

    def session(self, model: nn.Module | None = None, optimizer=None) -> RematSession:
        """A context manager; without ``model`` the first module called inside is the model."""
        return RematSession(self.config, model, optimizer)

    def apply(self, model: nn.Module, optimizer=None) -> Change:
        """Nothing is hooked now: the ``Change``'s ``context`` opens a ``session`` over
        ``model`` (and ``optimizer``, whose state the budget counts), entered around each
        effective batch; the blocks are evictable inside it only (Note 7)."""
        return Change(model, notes=(_NOTE,),
                      context=functools.partial(self.session, model, optimizer))
