"""Apply the allocator setting ``memfit.memplan.allocator_options`` picked, on CUDA.

Note 1 (expandable segments). ``PYTORCH_CUDA_ALLOC_CONF`` is read once, when CUDA's caching
allocator initialises, so ``use_expandable_segments`` must run before the first CUDA
allocation: afterwards it raises, naming what to do, rather than set a variable nobody reads.
A value already in the variable is kept (and, asked for again, is simply in force, even after
CUDA started); a contrary ``expandable_segments`` there is refused. On a machine without CUDA it
does nothing and returns False. ``allocator_expandable()`` reads the setting the variable gives
(``PYTORCH_ALLOC_CONF``, the newer name, first), which is what a started allocator runs with.

Note 2 (pools around phases). ``torch.cuda.use_mem_pool`` routes the current thread's allocations to
a ``MemPool`` (a block returns to its own pool when freed): ``PhasePools.on_phase`` is the
``on_phase`` callback of ``Runner.run`` / ``memfit.step.canonical_step``, leaving the previous
phase's pool and entering the next one's ("forward" -> pool F under "phase-pools", "optimizer" ->
pool O under both schemes); ``close`` leaves the last. The backward runs on autograd's thread and
stays in the default pool whatever is entered. Without CUDA every call is a no-op (``active`` is
False).

Note 3 (from a plan). ``Plan.allocator`` (chosen by ``api._plan_allocator``) reaches a Runner
through ``api._setup.build_runner``: its ``PhasePools`` become the Runner's ``on_phase`` and a
context around each effective batch; a plan needing expandable segments the running allocator
lacks is refused there, before the model is touched.

Neither can be exercised without a GPU: on this project's CPU machines only the refusals and
the CPU no-ops are tested (tests/memplan/test_mem_pools.py); benchmarks/gpu_check.py is where
a GPU would confirm the modelled bytes.
"""

from __future__ import annotations

import os

import torch

__all__ = ["PhasePools", "allocator_expandable", "use_expandable_segments", "SCHEMES"]

SCHEMES = ("default", "optimizer-pool", "phase-pools")
_POOLED = {"default": (), "optimizer-pool": ("optimizer",), "phase-pools": ("forward", "optimizer")}
_ENV = "PYTORCH_CUDA_ALLOC_CONF"
_ENVS = ("PYTORCH_ALLOC_CONF", _ENV)        # the newer name first, as c10 reads them


def _settings(text: str) -> dict[str, str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return {p.split(":", 1)[0].strip(): p.split(":", 1)[-1].strip() for p in parts}


def allocator_expandable() -> bool:
    """Whether the environment sets ``expandable_segments:True`` for the caching allocator."""
    for name in _ENVS:
        if name in os.environ:
            return _settings(os.environ[name]).get("expandable_segments", "").lower() == "true"
    return False


def use_expandable_segments(enabled: bool = True) -> bool:
    """Set ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` before CUDA starts (Note 1).
    Returns True if the setting was applied, False where there is no CUDA."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled must be True or False, got {enabled!r}")
    env = next((name for name in _ENVS if name in os.environ), _ENV)
    current = os.environ.get(env, "")
    given = _settings(current)
    want = "True" if enabled else "False"
    if "expandable_segments" in given and given["expandable_segments"].lower() != want.lower():
        raise ValueError(f"{env}={current!r} already sets expandable_segments:"
                         f"{given['expandable_segments']}; remove it from the environment, or "
                         f"keep it and do not ask memfit for expandable_segments={enabled}")
    if not torch.cuda.is_available():
        return False
    if "expandable_segments" in given or not enabled:   # already in force (Note 1)
        return True
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised, so the caching allocator has read "
                           f"{env} ({current or 'unset'}) and will not read it again: call "
                           "use_expandable_segments before the first CUDA tensor (before "
                           "moving the model to the GPU), or export "
                           f"{env}=expandable_segments:{want} before starting Python")
    os.environ[env] = ",".join([p for p in current.split(",") if p.strip()] +
                               [f"expandable_segments:{want}"])
    return True


class PhasePools:
    """``MemPool``s entered around the step's phases (Note 2)."""

    def __init__(self, scheme: str, device=None):
        if scheme not in SCHEMES:
            extra = (" ('class-pools' routes by lifetime class, which no PyTorch setting can: "
                     "memplan reports it for comparison only)") if scheme == "class-pools" else ""
            raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}{extra}")
        self.scheme = scheme
        self.active = torch.cuda.is_available() and bool(_POOLED[scheme])
        self.pools = {}
        if self.active:
            self.pools = {name: torch.cuda.MemPool() for name in _POOLED[scheme]}
        self.device = device
        self._entered = None

    def on_phase(self, name: str) -> None:
        """The step's phase ``name`` starts: leave the last phase's pool, enter this one's."""
        if name not in ("forward", "backward", "optimizer"):
            raise ValueError(f"unknown phase {name!r}: forward, backward or optimizer")
        if not self.active:
            return
        self.close()
        pool = self.pools.get(name)
        if pool is not None:
            self._entered = torch.cuda.use_mem_pool(pool, self.device)
            self._entered.__enter__()

    def close(self) -> None:
        """Leave the pool entered last (the blocks stay in their pools)."""
        if self._entered is not None:
            entered, self._entered = self._entered, None
            entered.__exit__(None, None, None)

    def __enter__(self) -> "PhasePools":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
