"""``OffloadedOptimizer``: the user's optimizer stepping fp32 host copies of the device
parameters, the optimizer ``techniques.optimizer_offload`` puts in its place.

Note 1 (the step). Each device parameter has a *host twin*: an fp32 (or wider) copy in host
memory, pinned on CUDA. The user's optimizer class is rebuilt over the twins (``inner``), so its
state is created, and lives, on the host. ``step()`` takes the device parameters that have a
gradient, in chunks of at most ``chunk_bytes`` host-gradient bytes; for each chunk it copies the
device gradients into fresh host gradients, runs ``inner.step()`` (twins without a gradient are
skipped, as torch optimizers skip them), frees the host gradients and copies the updated twins
back into the device parameters. Gradients accumulate on the device across micro-batches; only
``step()`` moves them. With fp32 parameters every update is the plain optimizer's op sequence on
the same values, so the result is bitwise equal; stepping by chunks is exact for optimizers
whose update of a parameter reads only that parameter's state (SGD, Adam(W), RMSprop, ...).

Note 2 (param groups). ``param_groups`` are the wrapper's own groups (it is a
``torch.optim.Optimizer``): the same hyper-parameters as the inner groups, with the *device*
parameters. Hyper-parameters are copied to the inner groups before each inner step and back
after it (an optimizer may write its own, e.g. D-Adaptation), so an LR scheduler that sets
``param_groups[i]["lr"]`` reaches the inner optimizer at the next step. ``GradScaler`` reads
``.grad`` of these device parameters, so ``unscale_`` (and its inf check) and ``clip_grad_norm_``
act on the device gradients before ``step()`` copies them; a step the scaler skips never runs.

Note 3 (accounting). Twins, host gradients, state and the inner step's temporaries are allocated
inside ``host_allocations()``, so ``memfit.track``/``estimate`` count them as host memory. Those
born before a tracked region (twins; state after the first step) are known to every tracker:
the optimizer registers itself as their owner (``measure._counting.register_host_owner``), else
their first read would count them on the device.

Note 4 (copies). On CUDA the twins and host gradients are pinned and copies are
``non_blocking``; the stream is synchronised before the inner step reads the host gradients.
Copies back to the device stay in flight: the next step's synchronise (or ``load_state_dict``'s)
orders them before the twins are written again. On the CPU nothing can be pinned (and nothing
is saved physically): a warning says so once per process. Fake tensors are never pinned.

Note 5 (gradients offloaded as they are produced, ``offload_gradients``). torchao's
``CPUOffloadOptimizer(offload_gradients=True)``: a post-accumulate-grad hook on each device
parameter copies its gradient into the twin's host gradient as soon as backward has
accumulated it and sets the device ``.grad`` to None, so the gradients never exist together on
the device. torchao copies (``copy_``) at every backward, so a second micro-batch overwrites the
first ("not compatible with gradient accumulation"); here the host gradient is the gradient:
the first backward after ``zero_grad`` copies into a fresh one, each later one adds the new
gradient to it (copied to a host buffer, then ``add_`` on the host: with fp32 gradients the same
sum the device's accumulation makes, so bitwise equal), and ``zero_grad`` frees (or zeroes)
the host gradients, as it would the device ones; ``host_tensors()`` names them (Note 3).
``step()`` steps the twins that have a host gradient (a device gradient set by hand, not by
backward, is moved first), in one inner step (chunks bound the host gradients the step makes;
these exist from backward on, so ``chunk_bytes`` is refused with them). What reads device
gradients reads None: ``clip_grad_norm_(max_norm)`` clips the host gradients (the same norm,
computed on the host), and ``GradScaler`` cannot unscale them (fp16 is refused by the caller).
The copy runs on the current stream (torchao uses a side stream): the device gradient is freed
after it in stream order, and an accumulation waits for its copy before adding. The hooks are
the ``Change``'s (``remove()`` takes them off and the optimizer copies device gradients at
``step()`` again); they hold the optimizer weakly (a strong hold would keep the parameters alive
through C++, out of the garbage collector's sight).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from memfit.measure import host_allocations
from memfit.measure._counting import register_host_owner
from memfit.measure.track import gradient_ready
from memfit.trace.profile import first_step_state_of

__all__ = ["OffloadedOptimizer", "Copy"]

Copy = Callable[[torch.Tensor, torch.Tensor], None]    # (dst, src) -> None, in place
_warned_unpinned = False


class OffloadedOptimizer(torch.optim.Optimizer):
    """The user's optimizer stepping host twins of the device parameters (Notes 1-4).

    ``build(twins) -> Optimizer`` makes ``inner``, the user's optimizer over the twins of
    ``params``; ``params``/``host_params``: the device parameters it holds and their twins, in
    the same order. ``state`` is the inner state keyed by device parameter. Made by
    ``OptimizerOffload.apply``.
    """

    def __init__(self, params: Iterable[torch.Tensor],
                 build: Callable[[list], torch.optim.Optimizer], *,
                 chunk_bytes: int | None = None, copy_to_host: Copy | None = None,
                 copy_to_device: Copy | None = None):
        params = list(params)
        self.chunk_bytes = chunk_bytes
        self.offload_gradients = False      # gradients to the host in backward (Note 5)
        self._pinned = any(p.device.type == "cuda" and not isinstance(p, FakeTensor)
                           for p in params)
        self._copy_to_host = copy_to_host or self._copy
        self._copy_to_device = copy_to_device or self._copy
        self._warn_if_unpinned(params)
        with host_allocations():
            twins = [self._new_twin(p) for p in params]
            self.inner = build(twins)
        device_of = {id(h): p for p, h in zip(params, twins)}
        groups = [{**g, "params": [device_of[id(h)] for h in g["params"]]}
                  for g in self.inner.param_groups]
        super().__init__(groups, self.inner.defaults)
        self.params = [p for g in self.param_groups for p in g["params"]]
        twin_of = {id(p): h for p, h in zip(params, twins)}
        self.host_params = [twin_of[id(p)] for p in self.params]
        self.state = _StateView(self.params, self.host_params, self.inner)
        register_host_owner(self)      # a tracker opened later counts them on the host (Note 3)

    # -- the step (Note 1) ------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(self.inner.step)
        return loss

    def steady_inner(self):
        """The optimizer whose first step differs from its next: this one's own step (the
        transfers around it) is the same in every step (trace.first_step)."""
        return self.inner

    @torch.no_grad()
    def first_step_state(self) -> None:
        """What a first ``step`` leaves, for a trace's warm-up: the same step, its transfers
        and releases included, with the inner optimizer's state made without its update where
        that optimizer can (``trace.profile.first_step_state_of``)."""
        self._step(first_step_state_of(self.inner))

    def _step(self, update) -> None:
        """``step``'s body around ``update``, the inner optimizer's step of each chunk."""
        on_host = self.offload_gradients          # the host gradients are there (Note 5)
        for p, h in zip(self.params, self.host_params) if on_host else ():
            if p.grad is not None:       # set, not made by backward: moved as a hook would
                self._grad_to_host(p, h)
        pairs = [(p, h) for p, h in zip(self.params, self.host_params)
                 if (h if on_host else p).grad is not None]
        self._sync_hyperparameters(to_inner=True)
        for chunk in self._chunks(pairs):
            with host_allocations():
                for p, h in chunk if not on_host else ():
                    h.grad = self._empty_host(h)
                    self._copy_to_host(h.grad, p.grad)
                self._synchronize()
                update()
                self._sync_hyperparameters(to_inner=False)
                for _, h in chunk if not on_host else ():
                    h.grad = None
            for p, h in chunk:
                self._copy_to_device(p, h)

    # -- gradients offloaded as they are produced (Note 5) ----------------------------------
    def gradients_to_host(self) -> list:
        """Register the hooks that move each gradient to the host in backward; their handles."""
        if self.chunk_bytes is not None:
            raise ValueError("offload_gradients with chunk_bytes: the host gradients exist from "
                             "backward on, all of them; leave chunk_bytes None")
        self.offload_gradients = True
        me = weakref.ref(self)       # held weakly (Note 5)

        def hook(p, h):
            if (opt := me()) is not None:
                opt._grad_to_host(p, h)
        return [p.register_post_accumulate_grad_hook(functools.partial(hook, h=h))
                for p, h in zip(self.params, self.host_params) if p.requires_grad]

    def gradients_on_device(self) -> None:
        """After the hooks are removed: ``step()`` copies device gradients again."""
        self.offload_gradients = False

    @torch.no_grad()
    def _grad_to_host(self, p: torch.Tensor, h: torch.Tensor) -> None:
        gradient_ready(p)       # a tracker counts it as a gradient before it is freed here
        with host_allocations():
            if h.grad is None:
                h.grad = self._empty_host(h)
                self._copy_to_host(h.grad, p.grad)
            else:                                   # a later micro-batch: add on the host
                part = torch.empty_like(h, pin_memory=self._pinned)
                self._copy_to_host(part, p.grad)
                self._synchronize()
                h.grad.add_(part)
                del part
        p.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for h in self.host_params if self.offload_gradients else ():
            if h.grad is not None and set_to_none:
                h.grad = None
            elif h.grad is not None:
                h.grad.zero_()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the gradients this optimizer steps: the
        device ones, or the host ones (Note 5)."""
        if not self.offload_gradients:
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self._synchronize()
        with host_allocations():
            return torch.nn.utils.clip_grad_norm_(self.host_params, max_norm)

    def _chunks(self, pairs: list) -> list[list]:
        if self.chunk_bytes is None:
            return [pairs] if pairs else []
        out, size = [], 0
        for p, h in pairs:
            nbytes = h.numel() * h.element_size()
            if not out or size + nbytes > self.chunk_bytes:
                out.append([])
                size = 0
            out[-1].append((p, h))
            size += nbytes
        return out

    def _sync_hyperparameters(self, to_inner: bool) -> None:
        """Copy every group key but "params" between the exposed and inner groups (Note 2)."""
        for mine, theirs in zip(self.param_groups, self.inner.param_groups, strict=True):
            src, dst = (mine, theirs) if to_inner else (theirs, mine)
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    # -- host memory and copies (Note 4) ----------------------------------------------------
    def _new_twin(self, p: torch.Tensor) -> nn.Parameter:
        # tensor methods, not factories: a fake ``p`` then makes a fake twin, in its mode or not
        dtype = torch.promote_types(p.dtype, torch.float32)
        if self._pinned:
            twin = torch.empty_like(p, dtype=dtype, device="cpu", pin_memory=True)
            twin.copy_(p.detach())
        else:
            device = p.device if p.device.type in ("cpu", "meta") else torch.device("cpu")
            twin = p.detach().to(device=device, dtype=dtype, copy=True)
        return nn.Parameter(twin, requires_grad=p.requires_grad)

    def _empty_host(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(like, pin_memory=self._pinned)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self._pinned)

    def _synchronize(self) -> None:
        if self._pinned:
            torch.cuda.current_stream(self.params[0].device).synchronize()

    @staticmethod
    def _warn_if_unpinned(params: list[torch.Tensor]) -> None:
        global _warned_unpinned
        real = [p for p in params if not isinstance(p, FakeTensor) and p.device.type != "meta"]
        if _warned_unpinned or not real or any(p.device.type == "cuda" for p in real):
            return
        _warned_unpinned = True
        warnings.warn(
            f"OptimizerOffload: the parameters are on '{real[0].device.type}', not CUDA, so the "
            "host copies are not pinned and copies are synchronous; host and device share this "
            "memory, so the offload saves nothing physically (memfit still counts the optimizer "
            "state as host memory). Warned once per process.", UserWarning, stacklevel=4)

    # -- the rest of the Optimizer surface ---------------------------------------------------
    def host_tensors(self) -> list[torch.Tensor]:
        """Every tensor held in host memory: the twins, their gradients (Note 5) and the inner
        optimizer's state."""
        out = list(self.host_params) + [h.grad for h in self.host_params if h.grad is not None]
        for state in self.inner.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "params"):          # Optimizer.__init__ adding the groups
            return super().add_param_group(param_group)
        raise NotImplementedError("OffloadedOptimizer cannot take new param groups: wrap an "
                                  "optimizer that already holds them all")

    def state_dict(self) -> dict:
        """The inner optimizer's state dict (torch's format: a plain optimizer over the device
        parameters can load it) plus ``"host_params"``, the twins (wider than bf16/fp16 ones)."""
        self._sync_hyperparameters(to_inner=True)
        out = self.inner.state_dict()
        out["host_params"] = [h.detach() for h in self.host_params]
        return out

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Load this class's or a plain optimizer's state dict (twins then come from the
        device parameters)."""
        self._synchronize()
        state_dict = dict(state_dict)
        twins = state_dict.pop("host_params", None) or [p.detach() for p in self.params]
        if len(twins) != len(self.host_params):
            raise ValueError(f"the state dict holds {len(twins)} host parameters; this optimizer "
                             f"has {len(self.host_params)}")
        with host_allocations():
            self.inner.load_state_dict(state_dict)
            with torch.no_grad():
                for h, saved in zip(self.host_params, twins):
                    h.copy_(saved)
        self._sync_hyperparameters(to_inner=False)


class _StateView(Mapping):
    """The inner optimizer's state, keyed by device parameter (read-only)."""

    def __init__(self, params, twins, inner):
        self._twin_of = {id(p): h for p, h in zip(params, twins)}
        self._params = params
        self._inner = inner

    def __getitem__(self, p):
        twin = self._twin_of.get(id(p))
        if twin is None or twin not in self._inner.state:
            raise KeyError(p)
        return self._inner.state[twin]

    def __iter__(self):
        return (p for p in self._params if self._twin_of[id(p)] in self._inner.state)

    def __len__(self):
        return sum(1 for _ in self)

