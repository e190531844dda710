"""Activation offload ("memory swap"): chosen blocks keep what they save for backward on the host.

Note 1 (hooks, and how they nest). A forward pre-hook on each chosen block enters a
``saved_tensors_hooks(pack, unpack)`` context; a forward post-hook (``always_call``) leaves it.
Autograd applies only the innermost pair of default hooks, so offload's pair *composes* with the
pair it finds (``_top_saved_tensors_default_hooks``), whose pack sees each tensor first: if it
returns the tensor itself (an observer: ``memfit.track``), offload proceeds and hands the outer
unpack what it brings back; otherwise (a checkpoint around the block's ``__call__``, e.g. on an
outer module, or ``save_on_cpu``) offload steps aside. Inside backward (a recompute calling a block)
nothing is pushed. Offload's pre-hook is prepended and its post-hook appended, so they run outside
every hook the block already has, and outside memfit's ``Checkpoint`` on the *same* block whichever
is applied first (checkpoint appends its pre-hook and prepends its post-hook); transformers' own
checkpoint runs around ``__call__``, outside them. A checkpoint inside: its hooks are innermost and
keep nothing, while what it saves for the recompute (the block's positional tensor inputs, saved
before its hooks are entered) goes through offload's pack and comes back when the recompute starts.
So recompute + offload keeps only a block's inputs, on the host; keyword tensors stay in its
closure.

Note 2 (what is offloaded). Plain strided (or fake) saved tensors of at least ``min_bytes``,
except parameters and views of the model's parameters and buffers (they stay on the device
anyway). The storage is copied whole and each view rebuilt on it (Note 3), so kernels see the
plain step's layout exactly; offload never touches the RNG: gradients are bitwise.

Note 3 (dedup, by storage). A step may save one tensor several times (``x * x`` saves ``x``
twice; llama's rotary ``cos``/``sin`` is saved by every block), or several views of one
storage (attention saves a transposed view beside its base). What is copied is the whole
storage, once, keyed by the storage and its version counter (written in place: copied again);
every save keeps only its view (offset, shape, strides, dtype) and is rebuilt on the storage
brought back, as autograd shared the original. So the host never holds more than the device
storages it frees, and the copy brought back is one storage as in the plain step.

Note 4 (the host pool). Host buffers are flat ``uint8`` tensors in one list. A copy takes the
smallest free buffer large enough (best fit), else a new one of exactly its size. A buffer is
free again when every save using it is gone (unpacked and released by autograd, or its graph
freed). When the last one goes (the end of backward) the pool frees its buffers, so that each
step's host bytes are born inside ``host_allocations()`` (``track`` would count a buffer kept
across its boundary as a device input); on CUDA the caching host allocator keeps the pages.

Note 5 (prefetch). Host copies are grouped by the block call that made them, in forward order
(a save deduplicated into an earlier call's copy adds none). When backward first unpacks a save
made by call i, group i's copies and group i-1's are brought back, before call i-1's backward
starts. The trigger is the call that made the save, not the call that owns its copy: a tensor
every block saves (llama's rotary ``cos``/``sin``) is copied by the first block, and its first
unpack, in the last block's backward, brings back that copy with the groups of the last block
and the one before it, as any of the last block's saves would, not all of the first block's
group at the start of backward.

Note 6 (copies). Both injected copies are ``(src, out) -> None`` into a tensor offload made:
a host buffer view (inside ``host_allocations``), or a new device tensor with the host copy's
strides (outside it, so device accounting stays honest). On CUDA they run on one side stream
per device (both directions, so a buffer's reuse is ordered after its last read), after what
the compute stream has queued, to pinned memory, ``non_blocking``. Memory is freed in stream
order, never through ``record_stream`` (whose lazy events let memory pile up while the CPU runs
ahead of the GPU): a saved tensor being copied out is held until its block's forward ends, when
the compute stream waits for the side stream; a copy back is allocated on the compute stream,
which waits on its event before using or dropping it. Elsewhere (CPU, fakes) copies are
synchronous; for real tensors a warning says so once per apply.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memfit.measure import find_blocks, host_allocations
from memfit.modes import Mode
from memfit.techniques._blocks import check_names, resolve_policy
from memfit.techniques._offload_pool import (OffloadStats, _flat, _HostPool, _is_wrapper,
                                             _same_view, default_copy)
from memfit.techniques._protocol import Change

__all__ = ["Offload", "OffloadStats", "MODES", "default_copy"]

MODES = (Mode.KEEP, Mode.OFFLOAD)


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Entry:
    """One host copy, shared by every save that deduplicates to it (Note 3)."""

    slot: int
    host: torch.Tensor | None
    target: torch.device          # where it comes back to
    group: int                    # the block call that first saved it (Note 5)
    cuda: bool                    # side-stream copies (Note 6)
    source: weakref.ref           # the saved storage: a dedup key is valid while it lives
    handles: int = 0              # live saves using this copy
    pending: int = 0              # of those, not yet unpacked
    device: torch.Tensor | None = None   # the copy brought back, until every save unpacked it
    event: object = None                 # CUDA: recorded after the copy back


@dataclass(eq=False, slots=True)
class _Packed:
    """What autograd holds for an offloaded save: a handle, not the tensor."""

    owner: "_Swapper"
    entry: _Entry
    view: tuple                   # (storage offset, shape, strides, dtype) of the save (Note 3)
    group: int                    # the block call that made this save (Note 5)
    unpacked: bool = False

    def __del__(self):
        self.owner.forget(self)


@dataclass(frozen=True, slots=True)
class _Outer:
    packed: object     # what an outer pack hook returned when it keeps the tensor itself (Note 1)


@dataclass(eq=False)
class _Swapper:
    """The runtime of one apply: module hooks, pack/unpack, pool, dedup map, prefetch."""

    model: nn.Module
    config: "Offload.Config"
    copy_to_host: object
    copy_to_device: object
    stats: OffloadStats = field(default_factory=OffloadStats)
    _contexts: list = field(default_factory=list)   # (block, entered hooks or None in backward)
    _groups: list = field(default_factory=list)     # weakrefs to entries per block call (Note 5)
    _reached: set = field(default_factory=set)      # groups backward has reached
    _by_key: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    _live: int = 0                                  # entries holding a host buffer
    _state: set = field(default_factory=set)        # storages of parameters and buffers
    _streams: dict = field(default_factory=dict)    # CUDA device -> side stream
    _stash: list = field(default_factory=list)      # CUDA: tensors being copied out (Note 6)
    _warned: bool = False

    def __post_init__(self):
        self.pool = _HostPool(self.stats)

    # -- module hooks (Note 1) --------------------------------------------------------------
    def enter(self, module, args) -> None:
        if torch._C._current_graph_task_id() != -1:
            self._contexts.append((module, None))
            return
        if self._live == 0 and not self._contexts:    # a new step: forget the last one's groups
            self._groups, self._reached = [], set()
            self._state = {x.untyped_storage()._cdata for x in
                           (*self.model.parameters(), *self.model.buffers())
                           if x.layout is torch.strided and not _is_wrapper(x)}
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._groups.append([])
        pack = functools.partial(self.pack, len(self._groups) - 1, outer)
        ctx = torch.autograd.graph.saved_tensors_hooks(pack, functools.partial(self.unpack, outer))
        ctx.__enter__()
        self._contexts.append((module, ctx))

    def exit(self, module, args, output) -> None:
        if self._contexts and self._contexts[-1][0] is module:
            ctx = self._contexts.pop()[1]
            if ctx is not None:
                ctx.__exit__(None, None, None)
        for device in {t.device for t in self._stash}:   # Note 6: freed in stream order
            torch.cuda.current_stream(device).wait_stream(self._side(device))
        self._stash.clear()

    # -- saved tensor hooks -----------------------------------------------------------------
    def pack(self, group: int, outer, t: torch.Tensor):
        if outer is not None:
            packed = outer[0](t)
            if packed is not t and not _same_view(packed, t):
                return _Outer(packed)
        if not self._offloadable(t):
            return t
        st = t.untyped_storage()
        key = (st._cdata, t._version)
        entry = self._by_key.get(key)
        if entry is not None and entry.source() is not None:
            self.stats.dedup_hits += 1
        else:
            entry = self._by_key[key] = self._offload(_flat(t), st, group)
        entry.handles += 1
        entry.pending += 1
        return _Packed(self, entry, (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype),
                       group)

    def unpack(self, outer, packed):
        if isinstance(packed, _Outer):
            return outer[1](packed.packed)
        x = self._bring_back(packed) if isinstance(packed, _Packed) else packed
        if isinstance(packed, _Packed):              # the save's view on the storage (Note 3)
            offset, shape, stride, dtype = packed.view
            x = x.view(dtype).as_strided(shape, stride, offset)
        return x if outer is None else outer[1](x)

    def forget(self, h: _Packed) -> None:
        """A save is gone (autograd released it): release what only it kept (Note 4)."""
        e = h.entry
        if not h.unpacked:
            e.pending -= 1
            if e.pending <= 0:
                self._drop_device_copy(e)
        e.handles -= 1
        if e.handles == 0:
            e.host = None
            self.pool.give(e.slot)
            self._live -= 1
            if self._live == 0:
                self.pool.trim()

    # -- mechanics --------------------------------------------------------------------------
    def _offloadable(self, t) -> bool:
        if (not isinstance(t, torch.Tensor) or isinstance(t, nn.Parameter) or _is_wrapper(t)
                or t.layout is not torch.strided or t.device.type == "meta"):
            return False
        nbytes = t.numel() * t.element_size()
        return (0 < nbytes and self.config.min_bytes <= nbytes
                and t.untyped_storage()._cdata not in self._state)

    def _offload(self, t: torch.Tensor, storage, group: int) -> _Entry:
        fake = isinstance(t, FakeTensor)
        cuda = t.device.type == "cuda" and not fake
        if not cuda and not fake and not self._warned:
            self._warned = True
            warnings.warn(f"Offload: no pinned memory or CUDA streams for {t.device} tensors: "
                          "copies to and from the host run synchronously", stacklevel=3)
        with host_allocations():
            slot, host = self.pool.take(t, pinned=cuda)
            try:
                with self._on_side(t.device if cuda else None):
                    self.copy_to_host(t, host)
            except BaseException:
                self.pool.give(slot)
                raise
        self._live += 1
        if cuda:
            self._stash.append(t)
        entry = _Entry(slot, host, t.device, group, cuda, weakref.ref(storage))
        self._groups[group].append(weakref.ref(entry))
        self.stats.copies += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        return entry

    def _bring_back(self, h: _Packed) -> torch.Tensor:
        e = h.entry
        if self.config.prefetch and h.group not in self._reached:     # Note 5
            self._reached.add(h.group)
            if e.device is None:
                self._load(e)
            for g in (h.group, h.group - 1):
                for ref in self._groups[g] if 0 <= g < len(self._groups) else ():
                    other = ref()
                    if other is not None and other.device is None and other.pending > 0:
                        self._load(other)
                        self.stats.prefetched += 1
        if e.device is None:
            self._load(e)
        t = e.device
        if not h.unpacked:
            h.unpacked = True
            e.pending -= 1
        if e.pending <= 0:
            self._drop_device_copy(e)
        elif e.event is not None:
            torch.cuda.current_stream(t.device).wait_event(e.event)
        return t

    def _load(self, e: _Entry) -> None:
        # allocated on the compute stream (Note 6); a new storage outside host_allocations
        out = e.host.new_empty(e.host.shape, device=e.target)
        with self._on_side(e.target if e.cuda else None):
            self.copy_to_device(e.host, out)
        if e.cuda:
            e.event = self._side(e.target).record_event()
        e.device = out
        self.stats.device_copies += 1

    def _drop_device_copy(self, e: _Entry) -> None:
        if e.event is not None:   # the compute stream may reuse its memory after the copy only
            torch.cuda.current_stream(e.target).wait_event(e.event)
        e.device = e.event = None

    def _side(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _on_side(self, device):
        """Run on ``device``'s side stream, after what the compute stream has queued so far."""
        if device is None:
            return contextlib.nullcontext()
        self._side(device).wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(self._side(device))


class Offload:
    """Keep what chosen blocks save for backward in host memory until backward needs it."""

    @dataclass(frozen=True)
    class Config:
        # "none" | "all" | "every:K" (the K-th, 2K-th, ... block, counted from 1, as Checkpoint)
        # | a tuple of the qualified names of the modules to offload
        policy: str | tuple[str, ...] = "none"
        min_bytes: int = 1024     # saved tensors smaller than this many bytes stay on the device
        prefetch: bool = True     # bring block i-1's tensors back when backward reaches block i

        def __post_init__(self):
            _check_policy(self.policy)
            if type(self.min_bytes) is not int or self.min_bytes < 0:
                raise ValueError(f"Offload.Config.min_bytes={self.min_bytes!r} must be an int "
                                 ">= 0 (bytes)")
            if not isinstance(self.prefetch, bool):
                raise ValueError(f"Offload.Config.prefetch={self.prefetch!r} must be a bool")

    def __init__(self, config: "Offload.Config", *, copy_to_host=None, copy_to_device=None):
        self.config = config
        # (saved tensor, host tensor to fill) -> None; runs inside host_allocations() (Note 6)
        self.copy_to_host = copy_to_host or default_copy
        # (host tensor, new device tensor to fill) -> None
        self.copy_to_device = copy_to_device or default_copy

    def resolve(self, model: nn.Module) -> dict[str, str]:
        """Block name -> ``Mode.KEEP`` or ``Mode.OFFLOAD``, blocks in execution order."""
        return resolve_policy(model, self.config.policy, Mode.OFFLOAD, "Offload")

    def apply(self, model: nn.Module, per_block: dict[str, str] | None = None) -> Change:
        """Hook the blocks ``per_block`` (default: ``resolve(model)``) marks ``Mode.OFFLOAD``.

        Everything is checked before any block is touched. The ``Change`` has the blocks'
        ``modes`` (KEEP or OFFLOAD) and live ``stats``; its ``remove()`` takes the hooks off
        (saves already offloaded still come back in their backward), its ``reapply()`` puts the
        same offload back (same blocks, config and copies, new stats)."""
        modes = self.resolve(model) if per_block is None else dict(per_block)
        bad = {n: str(m) for n, m in modes.items() if m not in MODES}
        if bad:
            raise ValueError(f"per_block modes {bad} are unknown: use one of "
                             f"{tuple(m.value for m in MODES)}")
        modes = {n: Mode.parse(m) for n, m in modes.items()}
        chosen = [n for n, m in modes.items() if m == Mode.OFFLOAD]
        check_names(model, chosen, find_blocks(model))
        nested = [(a, b) for a in chosen for b in chosen if b.startswith(a + ".")]
        if nested:
            raise ValueError(f"blocks {nested[0]} are nested: offload the outer one only")
        blocks = [model.get_submodule(n) for n in chosen]
        for name, block in zip(chosen, blocks):
            if any(isinstance(getattr(h, "__self__", None), _Swapper)
                   for h in block._forward_pre_hooks.values()):
                raise ValueError(f"block {name!r} is already offloaded: call remove() on the "
                                 "Change the first apply returned before applying again")
        swapper = _Swapper(model, self.config, self.copy_to_host, self.copy_to_device)
        hooks = []
        for block in blocks:
            hooks.append(block.register_forward_pre_hook(swapper.enter, prepend=True))
            hooks.append(block.register_forward_hook(swapper.exit, always_call=True))
        return Change(model, modes=modes, stats=swapper.stats, hooks=tuple(hooks),
                      redo=functools.partial(self.apply, model, modes))


def _check_policy(p) -> None:
    name = f"Offload.Config.policy={p!r}"
    if isinstance(p, tuple):
        if not p or not all(isinstance(n, str) for n in p):
            raise ValueError(f"{name}: a tuple must hold at least one module name (str); use "
                             "'none' to offload nothing")
    elif not isinstance(p, str):
        raise ValueError(f"{name} must be a str or a tuple of block names (not a list)")
    elif p == "selective":
        raise ValueError(f"{name} is a checkpoint policy (recompute chosen ops); offload moves "
                         "all a block saves: use 'all', 'every:K' or block names")
    elif p.startswith("every:"):
        if not p[6:].strip().lstrip("-").isdigit() or int(p[6:]) < 1:
            raise ValueError(f"{name}: K in 'every:K' must be an integer >= 1 (every:1: all)")
    elif p not in ("none", "all"):
        raise ValueError(f"{name} is unknown: use 'none', 'all', 'every:K' or block names")
