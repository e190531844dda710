"""Parameter offload: the weights of chosen blocks live on the host, fetched to the device just
before the block runs (forward, and again for its backward), with the next block prefetched
(ZeRO-3 offload / FSDP2's ``CPUOffloadPolicy``, for one device).

Note 1 (the host copy is the optimizer's twin). Parameter offload composes with optimizer offload
and needs it: ``OffloadedOptimizer`` already keeps an fp32 host twin of every parameter and steps
the twins (on the host, copying the results back), so the twin *is* the host copy of the weight and
nothing is duplicated. The device parameter of an offloaded block is *released* between uses
(``p.data`` set to a one-element placeholder expanded to the parameter's shape: its storage is
freed, while the ``nn.Parameter`` object, its shape (what ``zeros_like``, gradient checks and
clipping read), its ``.grad`` and every reference to it stay) and *fetched* (a new device tensor
copied from the twin, in the parameter's dtype, set as ``p.data``) when needed. The optimizer's copy
of an updated twin back to the device is replaced, for offloaded parameters, by a release
(``copy_to_device``, passed to ``OptimizerOffload``): the next fetch brings the new value. A weight
used while released would read the placeholder's zero: every path that runs a block's forward must
fetch first (Notes 2 and 3). Values are the plain offloaded step's to the bit: both copy the same
twin into the device parameter, and the math never changes.

Note 2 (forward). A forward pre-hook on each chosen block fetches its parameters (unless a
prefetch already did) and prefetches the next offloaded block (blocks in execution order,
``memfit.measure.find_blocks``); a forward post-hook (``always_call``) releases them. Inside
backward (a checkpoint's recompute calling the block) the pre-hook only fetches. Frozen
parameters (``requires_grad=False``) have no twin and stay on the device: not done yet.

Note 3 (backward: saved tensors). What a block saves for backward often is, or views, a
parameter's device storage (``addmm`` saves ``W.t()``; layer norm saves ``W``). Such a save
would keep the released storage alive, so while a block runs forward, a
``saved_tensors_hooks`` pair replaces each save whose storage is one of its fetched parameters
by a handle (parameter, view geometry); unpacking it fetches the block if backward has not
reached it yet, prefetches the offloaded block before it (each block backward reaches does, a
block fetched ahead included), and returns the same view on the fetched storage. Every save
first goes to the hooks found outside, as activation offload's do (``Offload``): if they keep
the tensor itself (an observer like ``memfit.track``, which then counts a fetched weight as
saved by the block, an activation), parameter offload proceeds; if they
transform it (a checkpoint around the block's call) it steps aside, keeping the block to fetch
when that save is unpacked. Other saves pass as the observer's reply (or a detached alias),
remembered weakly with their block: unpacking one also fetches the block. That is what makes
memfit's ``Checkpoint`` on the same block work: its recompute calls ``forward`` without the
block's hooks, but its pre-hook, which runs after parameter offload's (ours is prepended,
checkpoint's appended), saves the block's positional inputs through these hooks, and the
recompute starts by unpacking them. A checkpointed block whose forward takes no positional
tensor would recompute on released weights: not supported. ``Offload`` on the same block is
refused for now (its trace differed from the real run op by op: not yet understood).

Note 4 (release after backward). A parameter's device copy is released by its
post-accumulate-grad hook: every node that saved it produces a gradient for it, so all of them
have run once its gradient is accumulated. Gradients stay on the device until the optimizer
step copies them to the host (as under optimizer offload alone); moving each one to the host
as it is produced (FSDP's CPU offload) would need ``OffloadedOptimizer`` to accept host
gradients: not done yet.

Note 5 (accounting and copies). Fetched weights are born as device tensors (an op the counter
sees) and die at release; twins are host memory (``OffloadedOptimizer.host_tensors``). So
the estimate counts exactly what the device holds at each op, and CPU runs (where both are one
memory) are split as on a GPU. Copies are synchronous on the compute stream (``non_blocking``
from pinned twins on CUDA, ordered by the stream): a prefetch is issued early but overlaps
compute only once copies move to a side stream (as activation offload's do on CUDA): not done
yet.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.measure import find_blocks
from memfit.modes import Mode
from memfit.techniques._blocks import check_names, resolve_policy
from memfit.techniques._offload_pool import _same_view
from memfit.techniques._protocol import Change
from memfit.techniques.offload import _Swapper
from memfit.techniques.optimizer_offload import OffloadedOptimizer, OptimizerOffload

__all__ = ["ParamOffload", "ParamOffloadStats"]

@dataclass
class ParamOffloadStats:
    """Counters since ``apply``; bytes are device parameter bytes."""

    fetches: int = 0               # parameters copied host -> device
    fetched_bytes: int = 0
    prefetches: int = 0            # of those, for a block not running yet (Note 2, 3)
    releases: int = 0              # device copies freed


@dataclass(eq=False, slots=True)
class _Saved:
    """What autograd holds for a save of a parameter's storage (Note 3)."""

    param: nn.Parameter
    block: str                     # the offloaded block that holds it
    view: tuple                    # (storage offset, shape, strides) of the save


@dataclass(eq=False, slots=True)
class _Other:
    """A save the outer hooks transformed (a checkpoint around the block), and the block,
    which backward reaches when it is unpacked (Note 3)."""

    block: str
    packed: object


@dataclass(eq=False)
class _Fetcher:
    """The runtime of one apply: module hooks, saved-tensor hooks, fetch and release."""

    twin_of: dict[int, torch.Tensor]          # id(param) -> its host twin
    params_of: dict[str, list[nn.Parameter]]  # block name -> its offloaded parameters
    prefetch: bool
    stats: ParamOffloadStats = field(default_factory=ParamOffloadStats)
    _resident: set = field(default_factory=set)   # id(param) whose device copy is valid
    _order: list = field(default_factory=list)    # offloaded blocks in execution order
    _reached: set = field(default_factory=set)    # blocks fetched for this backward
    _storage: dict = field(default_factory=dict)  # storage _cdata -> param, while fetched
    _contexts: list = field(default_factory=list)
    _block_of: dict = field(default_factory=dict)  # id(param) -> its block
    active: bool = True                            # False once the Change is removed
    # what pack returned for a save that is not a parameter's -> its block (Note 3)
    _save_block: dict = field(default_factory=dict)   # id -> (weakref, block)

    def __post_init__(self):
        self._block_of = {id(p): n for n, ps in self.params_of.items() for p in ps}

    # -- fetch / release (Note 1) -----------------------------------------------------------
    def fetch(self, name: str, ahead: bool = False) -> None:
        for p in self.params_of[name]:
            if id(p) not in self._resident:
                self.fetch_one(p, ahead)

    def fetch_one(self, p: nn.Parameter, ahead: bool = False) -> None:
        twin = self.twin_of[id(p)]
        p.data = twin.detach().to(device=p.device, dtype=p.dtype, copy=True,
                                  non_blocking=twin.device.type != p.device.type)
        self._resident.add(id(p))
        self._storage[p.untyped_storage()._cdata] = p
        self.stats.fetches += 1
        self.stats.fetched_bytes += p.numel() * p.element_size()
        self.stats.prefetches += ahead

    def release(self, p: nn.Parameter) -> None:
        if id(p) not in self._resident:
            return
        self._storage.pop(p.untyped_storage()._cdata, None)
        self._resident.discard(id(p))
        p.data = p.data.new_zeros((1,)).expand(p.shape)      # a placeholder (Note 1)
        self.stats.releases += 1

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``OptimizerOffload``'s copy of an updated twin: a release for offloaded parameters
        (Note 1), else the default copy."""
        if self.active and id(dst) in self.twin_of:
            self.release(dst)
        else:
            dst.copy_(src, non_blocking=src.device.type != dst.device.type)

    def _neighbour(self, name: str, step: int) -> str | None:
        if not self.prefetch or name not in self._order:
            return None
        i = self._order.index(name) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    # -- module hooks (Note 2) --------------------------------------------------------------
    def enter(self, name: str, module, args) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        self.fetch(name)
        if in_backward:
            self._contexts.append((module, None))
            return
        self._reached.discard(name)
        nxt = self._neighbour(name, +1)
        if nxt is not None:
            self.fetch(nxt, ahead=True)
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        ctx = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self.pack, name, outer), functools.partial(self.unpack, outer))
        ctx.__enter__()
        self._contexts.append((module, ctx))

    def exit(self, name: str, module, args, output) -> None:
        if self._contexts and self._contexts[-1][0] is module:
            ctx = self._contexts.pop()[1]
            if ctx is None:
                return
            ctx.__exit__(None, None, None)
        if torch._C._current_graph_task_id() == -1:
            for p in self.params_of[name]:
                self.release(p)

    # -- saved tensor hooks (Note 3) --------------------------------------------------------
    def pack(self, name: str, outer, t):
        p = self._storage.get(t.untyped_storage()._cdata) if isinstance(t, torch.Tensor) \
            and t.layout is torch.strided else None
        packed = t
        if outer is not None:
            packed = outer[0](t)
            if packed is not t and not _same_view(packed, t):
                return _Other(name, packed)          # a checkpoint around the block (Note 3)
        if p is not None:
            view = (t.storage_offset(), tuple(t.shape), t.stride())
            return _Saved(p, self._block_of[id(p)], view)
        if not isinstance(packed, torch.Tensor):
            return packed
        if packed is t:      # an alias: a saved output must not hold its own node (a cycle)
            packed = t.detach()
        key = id(packed)                             # an observer's reply (Note 3)
        self._save_block[key] = (weakref.ref(packed, lambda _: self._save_block.pop(key, None)),
                                 name)
        return packed

    def unpack(self, outer, packed):
        if isinstance(packed, _Saved):
            p = packed.param
            self._reach(packed.block)
            if id(p) not in self._resident:
                self.fetch_one(p)
            offset, shape, stride = packed.view
            return p.detach().as_strided(shape, stride, offset)
        if isinstance(packed, _Other):
            self._reach(packed.block)
            return outer[1](packed.packed)
        ref, name = self._save_block.get(id(packed), (None, None))
        if ref is not None and ref() is packed:
            self._reach(name)
        return packed if outer is None else outer[1](packed)

    def _reach(self, name: str) -> None:
        """Backward reaches ``name``: fetch it, prefetch the block before it (Note 3)."""
        if name in self._reached:
            return
        self._reached.add(name)
        self.fetch(name)                          # a no-op where it was prefetched
        prev = self._neighbour(name, -1)
        if prev is not None and prev not in self._reached:
            self.fetch(prev, ahead=True)          # reached later, it prefetches its own prev

    def after_grad(self, p: nn.Parameter) -> None:      # Note 4
        self.release(p)


class ParamOffload:
    """Keep the weights of chosen blocks on the host between uses (Notes 1-5)."""

    @dataclass(frozen=True)
    class Config:
        # "none" | "all" | "every:K" | a tuple of block names (as ``Offload.Config.policy``)
        policy: str | tuple[str, ...] = "none"
        prefetch: bool = True     # fetch the next block ahead (forward) / the previous (backward)

        def __post_init__(self):
            p = self.policy
            if isinstance(p, str) and p == "selective":
                raise ValueError("ParamOffload.Config.policy='selective' is a checkpoint "
                                 "policy: use 'all', 'every:K' or block names")
            if not isinstance(p, (str, tuple)):
                raise ValueError(f"ParamOffload.Config.policy={p!r} must be a str or a tuple "
                                 "of block names")
            if not isinstance(self.prefetch, bool):
                raise ValueError(f"ParamOffload.Config.prefetch={self.prefetch!r} must be a "
                                 "bool")

    def __init__(self, config: "ParamOffload.Config"):
        self.config = config

    def resolve(self, model: nn.Module) -> dict[str, str]:
        """Block name -> ``Mode.KEEP`` or ``Mode.OFFLOAD``, blocks in execution order."""
        return resolve_policy(model, self.config.policy, Mode.OFFLOAD, "ParamOffload")

    def apply(self, model: nn.Module, optimizer,
              offload: "OptimizerOffload.Config | None" = None) -> Change:
        """Offload ``optimizer`` (a torch optimizer over ``model``'s parameters, not yet
        offloaded) with ``OptimizerOffload(offload)`` and hook the chosen blocks of ``model``.
        Everything is checked before the model is touched. The ``Change``'s ``optimizer`` is
        the offloaded one, ``stats`` live counters; ``modes`` is empty (the blocks' saved
        activations are as they were: ``resolve`` says whose weights are offloaded). Its
        ``remove()`` takes the hooks off and fetches every weight back (the optimizer stays
        offloaded and copies updated weights back again); ``reapply()`` offloads them again."""
        if isinstance(optimizer, OffloadedOptimizer) or not isinstance(
                optimizer, torch.optim.Optimizer):
            raise ValueError("ParamOffload.apply takes the optimizer before optimizer offload "
                             "(it offloads it itself, param_offload Note 1)")
        pending = self._prepare(model)
        offloaded = OptimizerOffload(offload or OptimizerOffload.Config(),
                                     copy_to_device=pending.copy_to_device).apply(model, optimizer)
        chosen = sum(m == Mode.OFFLOAD for m in pending.modes.values())
        note = (f"offload_params: the weights of {chosen} block(s) live in host memory (the "
                "optimizer's host copies), fetched to the device before each block's forward "
                "and backward")
        return pending.attach(offloaded.optimizer, (note, *offloaded.notes))

    def _prepare(self, model: nn.Module) -> "_Pending":
        modes = self.resolve(model)
        chosen = [n for n, m in modes.items() if m == Mode.OFFLOAD]
        check_names(model, chosen, find_blocks(model))
        nested = [(a, b) for a in chosen for b in chosen if b.startswith(a + ".")]
        if nested:
            raise ValueError(f"blocks {nested[0]} are nested: offload the outer one's "
                             "parameters only")
        hooks_of = {n: model.get_submodule(n)._forward_pre_hooks.values() for n in chosen}
        both = [n for n in chosen if any(isinstance(getattr(h, "__self__", None), _Swapper)
                                         for h in hooks_of[n])]
        if both:
            raise ValueError(f"block {both[0]!r} offloads its activations too: activation "
                             "offload and offload_params on the same block are not supported "
                             "yet (the estimate is not exact op by op); choose disjoint blocks")
        return _Pending(self.config, model, modes, chosen)


class _Pending:
    """A checked parameter-offload policy, waiting for the offloaded optimizer (Note 1)."""

    def __init__(self, config, model, modes, chosen):
        self.config, self.model, self.modes, self.chosen = config, model, modes, chosen
        self._fetcher: _Fetcher | None = None

    def copy_to_device(self, dst, src) -> None:
        """For ``OptimizerOffload(copy_to_device=...)`` (Note 1)."""
        if self._fetcher is None:
            dst.copy_(src)
        else:
            self._fetcher.copy_to_device(dst, src)

    def attach(self, optimizer, notes: tuple[str, ...]) -> Change:
        twin_of = {id(p): h for p, h in zip(optimizer.params, optimizer.host_params)}
        blocks = {n: self.model.get_submodule(n) for n in self.chosen}
        params_of = {}
        for n, b in blocks.items():
            ps = [p for p in b.parameters() if p.requires_grad]
            frozen = [p for p in ps if id(p) not in twin_of]
            if frozen:
                raise ValueError(f"block {n!r} has {len(frozen)} trainable parameter(s) the "
                                 "optimizer does not hold: build it from model.parameters()")
            params_of[n] = ps
        offloaded = {id(p) for ps in params_of.values() for p in ps}
        fetcher = _Fetcher({i: twin_of[i] for i in offloaded}, params_of,
                           self.config.prefetch, _order=list(self.chosen))
        hooks = []
        for n, b in blocks.items():
            # outside a checkpoint's hooks on the block, which are appended (Note 3)
            hooks.append(b.register_forward_pre_hook(functools.partial(fetcher.enter, n),
                                                     prepend=True))
            hooks.append(b.register_forward_hook(functools.partial(fetcher.exit, n),
                                                 always_call=True))
        for ps in params_of.values():
            for p in ps:
                hooks.append(p.register_post_accumulate_grad_hook(_weakly(fetcher.after_grad)))
                fetcher._resident.add(id(p))         # valid until the first release
                fetcher._storage[p.untyped_storage()._cdata] = p
        self._fetcher = fetcher
        return Change(self.model, optimizer=optimizer, optimizer_rebuilt=True, notes=notes,
                      stats=fetcher.stats, hooks=tuple(hooks),
                      on_remove=functools.partial(_fetch_back, fetcher),
                      redo=functools.partial(self.attach, optimizer, notes))


def _weakly(method):
    """``method`` as a tensor hook that does not keep its object alive. A parameter holds its
    post-accumulate-grad hooks from C++, where the garbage collector cannot see them: a hook
    holding the fetcher, which holds the parameters, made a cycle never collected, and a model
    dropped without ``remove()`` kept its weights and twins for the life of the process. The
    fetcher lives as long as the blocks' forward hooks, which hold it."""
    ref = weakref.WeakMethod(method)

    def hook(p):
        bound = ref()
        if bound is not None:
            bound(p)
    return hook


def _fetch_back(fetcher: _Fetcher) -> None:
    """After the hooks are off: every weight back on the device, for good (Note 1)."""
    fetcher.active = False
    for name in fetcher.params_of:
        fetcher.fetch(name)
