"""``memfit.track``: exact accounting of a real (or fake) run, op by op.

Ops are counted at op boundaries by ``_counting.CountingMode`` (a dispatch mode: bytes a
kernel frees inside itself are not seen); with a budget, an op that would pass it has no effect
and ``memfit.OutOfMemory`` is raised (docs/measurement.md).

Note 1 (categories). params and buffers of ``model``; grads (``p.grad``, seen by
post-accumulate hooks and at exit); optimizer (state tensors and master weights of
``optimizer``); inputs (storages alive before the region that are not model or optimizer
state, found when an op first reads them); activations (saved for backward); temporaries
(everything else born in the region). Buffers count as "other".

Note 2 (nested trackers, and what a tracker keeps). A tracker counts a real run, or
(``fake=True``, ``trace.profile``) a trace on fake tensors; a trace run inside a real region
(``estimate`` inside ``track``) is counted by its own tracker only: the real one lets its fake
ops through uncounted.
``active_tracker`` is the innermost region, so a traced step reads its own live bytes. After
its block a tracker keeps its figures and nothing it was given: the model, the optimizer and
the host tensors are dropped at exit, and its hooks are removed (``_modules.ModuleWatch``
removes each autograd hook it registers), so a kept ``Tracker`` keeps no tensor alive.

Note 3 (what a composed step needs). ``marks`` keeps each module entry and exit (and the
window's start) at its place between the ledger's events and the ops, so that a step made of
a shallow twin's pieces (``trace.block_reuse``) can place every module's window again; given
the model's ``blocks``, the tracker also labels each storage and op with its block
(``measure._labels``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.errors import OutOfMemory
from memfit.measure import _ledger as L
from memfit.measure._bnb_kernels import cpu_kernels
from memfit.measure.attached import attached_tensors, module_tensors
from memfit.measure._storage_resize import resizes_counted
from memfit.measure._counting import (CountingMode, allocates_and_writes, host_allocations,
                                      written_args, registered_host_tensors)
from memfit.measure._labels import StorageLabels
from memfit.measure._ledger import Ledger
from memfit.measure._modules import ModuleRecord, ModuleWatch, finish_records
from memfit.units import parse_bytes
from memfit.zoo._model_arg import check_model

__all__ = ["Tracker", "track", "host_allocations", "active_tracker", "gradient_ready"]

_running: list["Tracker"] = []     # trackers inside their ``with`` block, innermost last


def active_tracker(fake: bool | None = None) -> "Tracker | None":
    """The innermost ``track`` region running now, or None (the Runner's optimizer-step
    check reads its live bytes on the CPU); ``fake=True``: only a trace's, ``False``: only a
    real run's (what each counts, Note 2)."""
    t = _running[-1] if _running else None
    return t if t is None or fake is None or t.fake == fake else None


def gradient_ready(p: torch.Tensor) -> None:
    """Count ``p.grad`` as a gradient in every running ``track`` region: for a hook that steps
    and frees it before their own post-accumulate-grad hooks run (the optimizer in backward)."""
    for t in _running:
        t._grad_ready(p)


class Tracker:
    """Live-bytes accounting of everything run inside ``with track(...)``.

    After the block: ``peak_bytes``, ``breakdown`` (category -> bytes at the peak),
    ``timeline`` (live bytes after each op), ``timeline_by_category``, ``modules``
    (qualified name -> ``ModuleRecord``), ``fw_flops``/``bw_flops``, and on CUDA
    ``cuda_max_allocated_bytes``/``cuda_max_reserved_bytes`` from the caching allocator.
    """

    def __init__(self, model: nn.Module | None = None, optimizer=None, budget=None,
                 device: str | torch.device | None = None, host_tensors=(), fake: bool = False,
                 blocks: list[str] | None = None):
        self.model = model
        self.optimizer = optimizer
        self.budget_bytes = None if budget is None else parse_bytes(budget)
        self.device_type = _device_type(model, device)
        self.fake = fake      # a trace: count fake tensors (only them), Note 2
        self.ledger = Ledger(self.device_type, fake=fake)
        self.watch = ModuleWatch(model, self._module_enter, self._module_exit)
        self.ops = 0
        self.op_events: list[int] = []      # ledger event count after each op
        self.op_log: list = []              # the aten op of each counted op, in order
        # per op: FLOPs, bytes touched, of which training state (``_counting._touched_bytes``),
        # device bytes it allocated
        self.op_costs: list[tuple[int, int, int, int]] = []
        self.op_backward: list[bool] = []   # whether each op ran in a backward pass
        self.online_peak_bytes = 0
        self.fw_flops = 0
        self.bw_flops = 0
        self.last_op = None
        self.cuda_max_allocated_bytes: int | None = None
        self.cuda_max_reserved_bytes: int | None = None
        self._windows: list[tuple[str, str, int, int]] = []   # name, phase, start, end event
        self._open: dict[tuple[str, str], list[int]] = {}
        self._host_tensors = list(host_tensors)   # counted as host memory, not device
        self.host_before: set[int] = set()        # memfit's host memory from before the region
        self._window_event = 0                    # the peak is taken from this event on
        self._window_op = 0
        self._stack = contextlib.ExitStack()
        self._resolved = None
        self.failed_op: str | None = None       # op and module of an exception raised inside
        self.failed_module: str | None = None
        # Note 3: module entries and exits as (kind, name, phase, events, ops) in order, and
        # with ``blocks``, the block label of each storage and op
        self.marks: list[tuple[str, str, str, int, int]] = []
        self.labels = StorageLabels(blocks) if blocks else None
        self._graded: set[int] = set()       # ids of the parameters a gradient reached
        # after the region: the names of the model's trainable parameters no gradient reached
        # and that hold none (a trace gives them none in its warm-up then: trace.profile)
        self.ungraded: list[str] = []

    # -- context ----------------------------------------------------------------------------
    def __enter__(self) -> "Tracker":
        host_of = getattr(self.optimizer, "host_tensors", None)   # e.g. an offloaded optimizer
        # not kept: one freed inside the region (last step's host gradients) must be freed
        host = self._host_tensors + (list(host_of()) if callable(host_of) else [])
        # memfit's host memory born before the region, host at its first read (its owners
        # register themselves, ``register_host_owner``)
        self.host_before = {st._cdata for t in registered_host_tensors(self.fake)
                            for st in self.ledger.storages(t)}
        for t in host:
            for st in self.ledger.storages(t):
                if self.ledger.sid(st) is None:
                    self.ledger.add(st, L.OPTIMIZER, entry=True, host=True)
        self._register_state(entry=True)
        if self.labels is not None:
            self.labels.own(self.model, self.optimizer, self.ledger)
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        s = self._stack
        try:
            s.enter_context(self.watch)
            s.callback(self._remove_hooks, self._add_hooks())
            s.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
            s.enter_context(CountingMode(self))
            s.enter_context(resizes_counted(_running))   # storage.resize_ is no aten op
            if not self.fake:       # a real run's bitsandbytes CPU kernels, run as Python
                s.enter_context(cpu_kernels())
        except BaseException:
            s.close()
            raise
        s.callback(_running.remove, self)
        _running.append(self)
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self._register_state(entry=False)
        if self.labels is not None:
            self.labels.own(self.model, self.optimizer, self.ledger)
            self.labels.resolve()
        self.ledger.close()
        self._resolved = None       # a figure read inside the region saw only its start
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            self.cuda_max_allocated_bytes = torch.cuda.max_memory_allocated()
            self.cuda_max_reserved_bytes = torch.cuda.max_memory_reserved()
        self._finish_modules()
        if self.model is not None:
            self.ungraded = [name for name, p in self.model.named_parameters()
                             if p.requires_grad and id(p) not in self._graded and p.grad is None]
        self._graded = set()
        self.model = self.optimizer = None        # Note 2: the figures stay, the objects go
        self._host_tensors = []
        self.host_before = set()
        return False

    # -- results ----------------------------------------------------------------------------
    def start_window(self) -> None:
        """Take the peak, breakdown and timeline from here on (e.g. step 2 of 2); everything
        before still shapes what is live."""
        self._window_event = self.ledger.num_events
        self._window_op = len(self.op_events)
        self.marks.append(("window", "", "", self._window_event, self._window_op))
        self._resolved = None
        self.fw_flops = self.bw_flops = 0
        self.watch.reset_counts()

    @property
    def window_op_log(self) -> list:
        """The ops of the window, one per timeline point."""
        return self.op_log[self._window_op:]

    @property
    def window_op_costs(self) -> list[tuple[int, int, int, int]]:
        """(FLOPs, bytes touched, state bytes touched, bytes allocated) of each op of the window."""
        return self.op_costs[self._window_op:]

    def mark_host(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as host memory from now on."""
        for st in self.ledger.storages(t):
            self.ledger.set_host(st)

    def mark_unified(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage as unified memory, off the allocator and the host alike."""
        for st in self.ledger.storages(t):
            self.ledger.set_unified(st)

    @property
    def resolved(self) -> L.Resolved:
        if self._resolved is None or self.ledger.open:
            self._resolved = self.ledger.resolve(self._window_event)
        return self._resolved

    @property
    def host_peak_bytes(self) -> int:
        return self.resolved.host_peak_bytes

    @property
    def peak_bytes(self) -> int:
        return self.resolved.peak_bytes

    @property
    def current_bytes(self) -> int:
        r = self.resolved
        return r.at(self.ledger.num_events - 1)

    @property
    def breakdown(self) -> dict[str, int]:
        r = self.resolved
        return r.breakdown_at(r.peak_event)

    @property
    def start_breakdown(self) -> dict[str, int]:
        """Category -> live bytes when the window starts, the level its timeline starts from."""
        return self.resolved.breakdown_at(self._window_event - 1)

    @property
    def timeline(self) -> list[int]:
        """Live bytes after each op, in order (frees before the next op included)."""
        return self.resolved.series_at(self._window_events()).tolist()

    @property
    def timeline_by_category(self) -> dict[str, list[int]]:
        rows = self.resolved.by_category_at(self._window_events())
        return {name: rows[:, i].tolist() for i, name in enumerate(L.CATEGORIES)}

    def _window_events(self) -> np.ndarray:
        """The ledger event after each op of the window (-1: none yet)."""
        return np.asarray(self.op_events[self._window_op:], dtype=np.int64) - 1

    @property
    def modules(self) -> dict[str, ModuleRecord]:
        return self.watch.records

    # -- internals --------------------------------------------------------------------------
    def _register_state(self, entry: bool) -> None:
        """Count (at entry) or classify (at exit) the model's and optimizer's tensors."""
        led = self.ledger
        if self.model is not None:
            for p in self.model.parameters():
                led.mark_tensor(p, L.PARAMS, entry=entry)
                for t in attached_tensors(p):     # a quantized weight's scales
                    led.mark_tensor(t, L.PARAMS, entry=entry)
                if p.grad is not None:
                    led.mark_tensor(p.grad, L.GRADS, entry=entry)
            for b in self.model.buffers():
                led.mark_tensor(b, L.OTHER, entry=entry)
            for m in self.model.modules():        # Linear8bitLt.state's CB and SCB
                for t in module_tensors(m):
                    led.mark_tensor(t, L.PARAMS, entry=entry)
        if self.optimizer is not None:
            self._mark_optimizer(entry)

    def _mark_optimizer(self, entry: bool, *_):
        led = self.ledger
        model_params = set()
        if self.model is not None:
            model_params = {id(p) for p in self.model.parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in model_params:          # e.g. fp32 master weights
                    led.mark_tensor(p, L.OPTIMIZER, entry=entry)
                    if p.grad is not None:
                        led.mark_tensor(p.grad, L.GRADS, entry=entry)
        for state in self.optimizer.state.values():
            for v in tree_flatten(state)[0]:
                led.mark_tensor(v, L.OPTIMIZER, entry=entry)

    def _add_hooks(self) -> list:
        handles = []
        if self.model is not None:
            for p in self.model.parameters():
                if p.requires_grad:
                    handles.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_post_hook"):
            handles.append(self.optimizer.register_step_post_hook(
                lambda *a: self._mark_optimizer(False)))
        return handles

    @staticmethod
    def _remove_hooks(handles) -> None:
        for h in handles:
            h.remove()

    def _grad_ready(self, p) -> None:
        self._graded.add(id(p))
        if p.grad is not None:
            self.ledger.mark_tensor(p.grad, L.GRADS)

    def _pack(self, x):
        """Mark what autograd saves as activations and charge it to the running modules.

        A storage not yet counted here can only come from outside the region (an op's outputs
        are counted before autograd saves them), so it is counted as an entry input.
        """
        if isinstance(x, torch.Tensor):
            led = self.ledger
            for st in led.storages(x):
                sid = led.sid(st)
                if sid is None:
                    sid = led.add(st, L.INPUTS, entry=True)
                led.mark(st, L.ACTIVATIONS)
                if self.watch.stack and led.category_of(st) not in (L.PARAMS, L.OTHER):
                    self.watch.saved(st, sid, led.nbytes_of_sid(sid))
            # an alias without grad_fn: a saved *output* returned as is would hold its own
            # grad_fn from C++ (tensor <-> node cycle the gc cannot see), so a forward that
            # raised mid-way would never free its activations. A tensor with no grad_fn (a
            # weight, a mask) has no node to cycle through and is kept as autograd keeps it:
            # a third to a half of what a transformer saves, each detach one op less
            return x if x.grad_fn is None else x.detach()
        return x

    def _module_enter(self, name: str, phase: str) -> None:
        self.marks.append(("enter", name, phase, self.ledger.num_events, len(self.op_events)))
        self._open.setdefault((name, phase), []).append(self.ledger.num_events)

    def _module_exit(self, name: str, phase: str) -> None:
        self.marks.append(("exit", name, phase, self.ledger.num_events, len(self.op_events)))
        starts = self._open.get((name, phase))
        if starts:
            self._windows.append((name, phase, starts.pop(), self.ledger.num_events - 1))

    def _finish_modules(self) -> None:
        end = self.ledger.num_events - 1
        for (name, phase), starts in self._open.items():     # windows still open at exit
            for s in starts:
                self._windows.append((name, phase, s, end))
        self._open.clear()
        finish_records(self.watch.records, self._windows, self.resolved,
                       self.op_events[self._window_op:], self._window_event)

    @contextlib.contextmanager
    def undo_on_oom(self, func, args):
        """Run one op so that, if it raises ``OutOfMemory``, it leaves no trace: its outputs
        dropped, a random op's generator and the inputs it wrote restored."""
        rng = torch.get_rng_state() if torch.Tag.nondeterministic_seeded in func.tags else None
        written = written_args(func, args) if allocates_and_writes(func) else []
        backup = [w.detach().clone() for w in written]
        try:
            yield
        except OutOfMemory:
            with torch.utils._python_dispatch._disable_current_modes():
                for w, b in zip(written, backup):
                    w.detach().copy_(b)
                if rng is not None:
                    torch.set_rng_state(rng)
            raise
        except Exception as e:
            self.note_failure(e, func)
            raise

    def note_failure(self, e: Exception, func) -> None:
        """Say, on the exception, which op and module raised it (once)."""
        if hasattr(e, "add_note") and not getattr(e, "_memfit_noted", False):
            where = self.watch.innermost
            e.add_note(f"memfit: raised by {func}" + (f" in module '{where}'" if where else ""))
            e._memfit_noted = True
        self.failed_op = str(func)
        self.failed_module = self.watch.innermost


def _unpack(x):
    return x


def _device_type(model, device) -> str:
    if device is not None:
        return torch.device(device).type
    if model is not None:
        for p in model.parameters():
            return p.device.type
    return "cpu"


def track(model: nn.Module | None = None, optimizer=None, budget=None,
          device: str | torch.device | None = None) -> Tracker:
    """Measure the live tensor bytes of the code run inside ``with track(...) as t:``.

    ``model``/``optimizer`` let memfit count their tensors from the start and sort bytes into
    categories; ``budget`` (bytes, or a string like ``"11GiB"``) makes the op that would cross
    it raise ``memfit.OutOfMemory`` without effect; ``device`` picks the device whose bytes
    count (default: where the model is, else the CPU).
    """
    if model is not None:
        check_model(model, "track's model")
    if optimizer is not None and not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")):
        raise ValueError(f"track's optimizer must be a torch.optim.Optimizer instance (or None), got "
                         f"{type(optimizer).__name__} {optimizer!r}")
    return Tracker(model=model, optimizer=optimizer, budget=budget, device=device)
