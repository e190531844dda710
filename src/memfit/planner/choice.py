"""What the planner's search weighs and answers: a ``Choice`` (one configuration with what the
models predict for it), the key of the models it was predicted with (``variant_key``), and
the ``Constraints`` the caller fixed (``planner.search`` searches under them).

Note 1 (fixed knobs, per side). A fixed ``checkpoint`` names the blocks recomputed and how; the
blocks it leaves out may still be kept or offloaded. A fixed ``offload`` names the blocks
offloaded; the others may still be kept or recomputed. ``Constraints.modes`` holds, per block
named, the modes it may take; a block it does not name takes any.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.modes import Mode
from memfit.planner.memory_model import MODES
from memfit.techniques._blocks import resolve_policy

__all__ = ["Choice", "Constraints", "variant_key", "unkey"]


@dataclass(frozen=True)
class Choice:
    """One configuration and what the models predict for it."""

    precision: str
    micro_batch_size: int
    modes: tuple[Mode, ...]          # per block, in execution order (strings are parsed)
    offload_optimizer: bool
    allocated_bytes: int             # predicted allocated peak
    device_bytes: int                # predicted device bytes (allocated x traced reserve ratio)
    step_s: float                    # predicted step time
    optimizer_impl: str | None = None  # the optimizer implementation (None: as given)
    optimizer_state: str | None = None   # a low-bit state memfit chose (None: as given)
    offload_params: str | None = None    # block weights on the host (None: as given)
    chunked_loss: int | None = None      # the loss in this many pieces (None: as given)
    optimizer_in_backward: bool | None = None   # stepped in backward (None: as given)
    offload_gradients: bool | None = None   # gradients to the host in backward (None: as given)
    mix_step_s: float | None = None  # one mode taken over a mix this fast (search), else None

    def __post_init__(self):
        object.__setattr__(self, "modes", tuple(Mode.parse(m) for m in self.modes))

    @property
    def key(self) -> tuple:
        """The ``models`` key this choice was predicted with (``variant_key``)."""
        return variant_key(self.precision, self.optimizer_impl, self.optimizer_state,
                           self.offload_params, self.chunked_loss, self.optimizer_in_backward,
                           self.offload_gradients)


def variant_key(precision: str, impl: str | None = None, state: str | None = None,
                params: str | None = None, chunked: int | None = None,
                in_backward: bool | None = None, grads: bool | None = None) -> tuple:
    """A key of the planner's ``models``: one memory and time model per precision and optimizer
    implementation, ``(precision, impl)`` (``impl`` None: the optimizer as given), longer only
    where a lever beyond the per-block modes is set (a low-bit state, the block weights on the
    host, the loss in pieces, the optimizer in backward, the gradients to the host)."""
    if grads:
        return precision, impl, state, params, chunked, in_backward, True
    if in_backward:
        return precision, impl, state, params, chunked, True
    if chunked is not None:
        return precision, impl, state, params, chunked
    if state is None and params is None:
        return precision, impl
    return precision, impl, state, params


def unkey(key: tuple) -> tuple:
    """``key`` padded to its seven fields (``variant_key``'s order)."""
    return tuple(key) + (None,) * (7 - len(key))


@dataclass(frozen=True)
class Constraints:
    """What the user fixed (``None``: free)."""

    micro_batch_size: int | None = None
    modes: dict[str, tuple[Mode, ...]] | None = None   # block name -> modes it may take (Note 1)
    offload_optimizer: bool | None = None

    @classmethod
    def of(cls, model, k, b: int) -> "Constraints":
        """What the caller fixed in ``k`` (a ``Knobs``), knob by knob, for a batch of ``b``
        (Note 1)."""
        modes = None
        if k.checkpoint is not None or k.offload is not None:
            per = resolve_policy(model, k.checkpoint or "none", Mode.RECOMPUTE, "Checkpoint")
            off = resolve_policy(model, k.offload or "none", Mode.OFFLOAD, "Offload")
            modes = {}
            for name in set(per) | set(off):
                rec = per.get(name, Mode.KEEP) if k.checkpoint is not None else None
                moved = off.get(name) == Mode.OFFLOAD if k.offload is not None else None
                if moved:                   # offloaded (recomputed too: the search mirrors it)
                    modes[name] = (Mode.OFFLOAD,)
                elif rec not in (None, Mode.KEEP):
                    modes[name] = (rec,)
                elif rec == Mode.KEEP:      # not recomputed: kept, or offloaded if free
                    modes[name] = (Mode.KEEP,) if moved is False else (Mode.KEEP, Mode.OFFLOAD)
                else:                       # recompute free, not offloaded
                    modes[name] = (Mode.KEEP, Mode.RECOMPUTE, Mode.SELECTIVE)
        m = k.micro_batch_size
        oo = k.offload_optimizer
        if oo is None and (k.offload_params not in (None, "none") or
                           getattr(k, "offload_gradients", None)):
            oo = True       # parameter / gradient offload need it: the host copy is its twin
        if getattr(k, "optimizer_in_backward", None):     # no accumulation, state on the device
            m, oo = b if m is None else m, False if oo is None else oo
        return cls(None if m is None else min(m, b), modes, oo)

    def allowed(self, name: str) -> tuple[Mode, ...]:
        return MODES if self.modes is None else self.modes.get(name, MODES)

    def keep_allowed(self, blocks) -> bool:
        return all(Mode.KEEP in self.allowed(n) for n in blocks)
