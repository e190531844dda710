"""DTR's unit of eviction: one call of one block, its saved tensors, and how to recompute them.

``memfit.techniques.remat`` explains the mechanism (what a unit is, what eviction can free, when
it evicts), and docs/techniques/dtr.md sums it up; this file holds the mechanics.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import get_device_states, set_device_states
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["Saved", "Unit", "FromUnit", "autocast_state", "replay_autocast"]

_storage_use_count = torch._C._storage_Use_Count


class Saved:
    """What autograd holds for one saved tensor of a unit; eviction sets ``tensor`` to None.

    ``tensor`` is the (outer-packed) tensor, or ``None`` while evicted; ``version`` its version
    counter when saved (written in place since: the unit cannot be recomputed to the same values
    and is never evicted)."""

    __slots__ = ("tensor", "unit", "index", "version", "__weakref__")

    def __init__(self, tensor, unit: "Unit", index: int):
        self.tensor = tensor
        self.unit = unit
        self.index = index
        self.version = tensor._version if isinstance(tensor, torch.Tensor) else None


class FromUnit:
    """An input slot whose tensor was dropped because its producer ``unit`` is evicted too: that
    unit's output ``path``, recomputed from it."""

    __slots__ = ("unit", "path")

    def __init__(self, unit: "Unit", path: int):
        self.unit = unit
        self.path = path


def autocast_state() -> list[tuple[str, bool, torch.dtype, bool]]:
    """The autocast settings in force now, per device type that has autocast (a recompute
    replays them)."""
    out = []
    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not torch.cuda.is_available():
            continue
        out.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev),
                    torch.is_autocast_cache_enabled()))
    return out


class replay_autocast:  # noqa: N801 - a context manager used like a function
    """Enter the autocast settings recorded by ``autocast_state``."""

    def __init__(self, state):
        self.ctxs = [torch.autocast(dev, dtype=dtype, enabled=on, cache_enabled=cache)
                     for dev, on, dtype, cache in state]

    def __enter__(self):
        for c in self.ctxs:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.ctxs):
            c.__exit__(*exc)
        return False


class Unit:
    """One forward call of one block, recomputable from its inputs: DTR's unit of eviction."""

    _replay_rng = True   # tests switch it off to show that RNG replay is what they test

    def __init__(self, session, name: str, fn, args: tuple, kwargs: dict, outer_hooks):
        self.session = session
        self.name = name
        self.fn = fn                           # the block's original bound forward
        self.flat, self.spec = tree_flatten((args, kwargs))
        self.versions = [x._version if isinstance(x, torch.Tensor) else None for x in self.flat]
        self.requires = [isinstance(x, torch.Tensor) and x.requires_grad for x in self.flat]
        self.producers: dict[int, tuple[Unit, int]] = {}   # input slot -> (unit, output index)
        self.devices, self.device_states = get_device_states(*self.flat)
        self.cpu_rng = torch.get_rng_state()
        self.autocast = autocast_state()
        self.outer = outer_hooks               # (pack, unpack) found on entry, or None
        self.handles: list[weakref.ref] = []
        self.alive = 0                         # handles autograd still holds
        self.outputs: list[weakref.ref] = []   # the tensors the forward returned
        self.cost_flops = 0                    # forward FLOPs (the heuristic's cost)
        self.last = session.clock              # op count at the last use (staleness)
        self.evicted = False
        self.busy = False                      # being run or recomputed: not a candidate
        self.refused: str | None = None        # why it may never be evicted (an in-place write)
        self.recomputes = 0

    # -- forward ----------------------------------------------------------------------------
    def pack(self, x):
        y = self.outer[0](x) if self.outer is not None else x
        if isinstance(y, torch.Tensor):
            y = y.detach()                     # no reference cycle through grad_fn
        h = Saved(y, self, len(self.handles))
        self.handles.append(weakref.ref(h, self._handle_died))
        self.alive += 1
        return h

    def unpack(self, h: Saved):
        if h.tensor is None:
            self.session.rematerialize(self)
        self.last = self.session.clock
        self.session.active = self
        return self.outer[1](h.tensor) if self.outer is not None else h.tensor

    def _handle_died(self, _ref) -> None:
        self.alive -= 1
        if self.alive == 0:
            self.release()

    def finish(self, out, flops: int) -> None:
        """After the forward: remember outputs and cost, check in-place writes of inputs."""
        self.cost_flops = flops
        self.last = self.session.clock
        self.outputs = [weakref.ref(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for i, x in enumerate(self.flat):
            if isinstance(x, torch.Tensor) and x._version != self.versions[i]:
                self.refused = f"its forward writes input {i} in place"

    def release(self) -> None:
        """Backward is done with this unit: let its inputs go."""
        self.flat = []
        self.producers = {}
        self.handles = []
        self.session.retire(self)

    # -- eviction ---------------------------------------------------------------------------
    def check_recomputable(self) -> str | None:
        """Why the unit cannot be recomputed exactly now (an input or a saved tensor written in
        place), or None."""
        if self.refused:
            return self.refused
        for i, x in enumerate(self.flat):
            if isinstance(x, torch.Tensor) and x._version != self.versions[i]:
                self.refused = f"input {i} was written in place after the forward"
                return self.refused
        for ref in self.handles:
            h = ref()
            if h is not None and isinstance(h.tensor, torch.Tensor) and \
                    h.tensor._version != h.version:
                self.refused = "a saved tensor was written in place after it was saved"
                return self.refused
        return None

    def droppable_inputs(self) -> dict[int, tuple["Unit", int]]:
        """Input slots whose producer is itself evicted, so recomputing it is already owed
        anyway: dropping them adds to the evicted neighbourhood, not to the work."""
        return {i: p for i, p in self.producers.items()
                if isinstance(self.flat[i], torch.Tensor) and p[0].flat and p[0].evicted}

    def freeable(self, inputs: bool = False) -> tuple[int, int]:
        """(bytes evicting would free now, bytes held elsewhere): of the saved tensors, or
        (``inputs``) of the droppable inputs. A storage frees only when the unit holds every use
        of it (``_storage_Use_Count``); parameters, outputs held by the next block stay."""
        if inputs:
            tensors = [self.flat[i] for i in self.droppable_inputs()]
        else:
            tensors = [h.tensor for h in (r() for r in self.handles)
                       if h is not None and isinstance(h.tensor, torch.Tensor)]
        held: dict[int, list] = {}
        for t in tensors:
            st = t.untyped_storage()
            entry = held.setdefault(st._cdata, [st.nbytes(), set()])
            entry[1].add(id(t))
        free = pinned = 0
        for key, (nbytes, ids) in held.items():
            if _storage_use_count(key) - 1 <= len(ids):    # -1: the query's own storage object
                free += nbytes
            else:
                pinned += nbytes
        return free, pinned

    def evict(self) -> None:
        """Drop the saved tensors (the inputs stay: ``drop_inputs``)."""
        for ref in self.handles:
            h = ref()
            if h is not None and isinstance(h.tensor, torch.Tensor):
                h.tensor = None
        self.evicted = True

    def drop_inputs(self) -> list["Unit"]:
        """Drop the droppable inputs (their producers are evicted); return the producers."""
        dropped = self.droppable_inputs()
        for i, (unit, k) in dropped.items():
            self.flat[i] = FromUnit(unit, k)
        return [unit for unit, _ in dropped.values()]

    # -- recompute --------------------------------------------------------------------------
    def inputs(self) -> tuple[tuple, dict]:
        """The forward's inputs, recomputing dropped ones from their producers."""
        for i, x in enumerate(self.flat):
            if isinstance(x, FromUnit):
                outs = self.session.rematerialize(x.unit, need_outputs=True)
                self.flat[i] = outs[x.path]
                self.versions[i] = self.flat[i]._version
        detached = [x.detach().requires_grad_(r) if isinstance(x, torch.Tensor) else x
                    for x, r in zip(self.flat, self.requires)]
        args, kwargs = tree_unflatten(detached, self.spec)
        return args, kwargs

    def recompute(self) -> list:
        """Run the forward again exactly as the first time (the recorded RNG states and autocast
        settings, detached inputs with the same ``requires_grad``); refill evicted handles;
        return the outputs (detached)."""
        args, kwargs = self.inputs()
        captured = []

        def capture(x):
            # the rerun's graph is never backwarded: keep nothing in it (a saved output packed
            # as itself would hold its own grad_fn, a cycle that never frees)
            y = self.outer[0](x) if self.outer is not None else x
            captured.append(y.detach() if isinstance(y, torch.Tensor) else y)

        with torch.random.fork_rng(devices=self.devices):
            if self._replay_rng:
                torch.set_rng_state(self.cpu_rng)
            if self.devices and self._replay_rng:
                set_device_states(self.devices, self.device_states)
            with torch.enable_grad(), replay_autocast(self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(capture, _identity):
                out = self.fn(*args, **kwargs)
        if len(captured) != len(self.handles):
            raise RuntimeError(
                f"remat: block '{self.name}' saved {len(captured)} tensors when recomputed but "
                f"{len(self.handles)} in its forward: its forward is not deterministic in what it "
                "runs (data-dependent branches?). Leave this block out of remat, or use "
                "checkpoint='all'.")
        for ref in self.handles:
            h = ref()
            if h is not None and h.tensor is None:
                h.tensor = captured[h.index]
        self.evicted = False
        self.recomputes += 1
        return [t.detach() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _identity(x):
    return x
