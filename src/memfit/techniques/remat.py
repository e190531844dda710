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
``track`` already enforces one at least as tight); it counts the model's and optimizer's tensors
from the start when the session is given them, anything else from its first use by an op. On
CUDA ``set_per_process_memory_fraction`` makes the allocator refuse past it. Without a budget
nothing is watched: remat evicts only when an allocation fails (CUDA: the allocator's
``OutOfMemoryError``; CPU: an enclosing ``track(budget=...)``'s ``memfit.OutOfMemory``). Either
way the failed op had no effect (track undoes it; the allocator allocates nothing), remat
evicts until the missing bytes are freed and runs the op again. A short batch therefore evicts
nothing, and a batch of another length needs no planning. When nothing more can be evicted,
``RematBudgetTooSmall`` names the numbers (raised from forward or backward, before the
optimizer step, so parameters and optimizer state are as they were).
Enter ``remat`` *inside* ``track``: the innermost dispatch mode sees each op first, and remat's
must be above the counter whose error it catches.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.flop_counter import flop_registry

from memfit.measure import Tracker, find_blocks
from memfit.measure._counting import CountingMode
from memfit.techniques._remat_evict import Eviction, RematBudgetTooSmall, RematStats
from memfit.techniques._remat_units import Unit
from memfit.techniques.checkpoint import CACHE_ARGS

__all__ = ["Remat", "RematSession", "RematStats", "RematBudgetTooSmall"]

log = logging.getLogger("memfit.remat")


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
            except RematBudgetTooSmall:          # from a recompute inside: already final
                raise
            except torch.OutOfMemoryError as e:
                if not s.make_room(e):
                    raise s.too_small(e, func) from e
                s.stats.retries += 1


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
                s.enter_context(Tracker(model=self.model, optimizer=self.optimizer,
                                        budget=budget, device=device))
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
        """Whose bytes the budget caps: the model's device, else CUDA where there is one."""
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

    def session(self, model: nn.Module | None = None, optimizer=None) -> RematSession:
        """A context manager; without ``model`` the first module called inside is the model."""
        return RematSession(self.config, model, optimizer)
