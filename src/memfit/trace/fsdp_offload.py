"""FSDP2's CPU offload as a GPU places it, traced on the CPU.

Note 1 (what moves where). Under ``CPUOffloadPolicy`` FSDP2 keeps every sharded parameter and
its gradient in host memory, so the optimizer steps on the host, over host state. A rank's
device holds the rest: the all-gather buffers and unsharded parameters, the reduce-scatter
buffers, activations. The device additionally holds, for the length of one all-gather's
copy-in, a device copy of each host shard of the group (``FSDPParam.all_gather_inputs``:
``sharded_param.to(device)``), and, until its reduce ends, the reduce-scatter output, which
the gradients are then copied out of to the host (``foreach_reduce``).

Note 2 (why the CPU trace needs telling). On a CPU target those moves are no-ops
(``tensor.to("cpu")`` of a CPU tensor is itself, never dispatched), so the trace sees the host
shards read in place and the reduce-scatter output become the gradient; for the CPU that is
exact. For a GPU target ``OffloadPlacement`` tells the ledger what a GPU does (its
``set_host`` / ``move_to_host`` / ``transient`` events), with nothing taken from FSDP2's
internals but its public behaviour:
  - at the counted step's start, the parameters, their gradients (the previous step's) and the
    optimizer state are host memory (``host_tensors``, read by the tracker at its start);
  - each parameter's post-accumulate-grad hook (FSDP2 calls them right after it sets the
    sharded gradient) moves the gradient's storage to the host: the device bytes of the
    reduce-scatter output die there, as FSDP2 drops it once its copies are made (a group's
    gradients share that one output, moved at the group's first hook; no device allocation
    happens between it and the last);
  - the optimizer phase allocates on the host (``host_allocations``): its temporaries, like
    its state, are host tensors;
  - an op of the forward or backward that reads host storages into new storages (the
    all-gather's copy-in of the host shards, or, under a mixed-precision policy, the cast of
    each) reads device copies of them: a transient of their bytes, born before the op's
    outputs and dead after them. Views and in-place ops make no copy (a copy into a device
    buffer reads the host directly; an add into a host gradient runs on the host).
Not modelled: the pinned host staging copies (host bytes, not the device's), and under a
mixed-precision policy the one fp32 device copy alive during each cast (the cast's input:
one parameter's shard at a time).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memfit.measure import host_allocations
from memfit.measure._counting import host_allocations_open
from memfit.measure.track import active_tracker

__all__ = ["OffloadPlacement"]


def _fake_tracker():
    return active_tracker(fake=True)                    # the trace's, not a real run's


def _grad_set(param) -> None:
    """A shard's gradient lives on the host (Note 2)."""
    tracker = _fake_tracker()
    if tracker is not None and param.grad is not None:
        for st in tracker.ledger.storages(param.grad):
            tracker.ledger.move_to_host(st)


class OffloadPlacement:
    """Tell a fake trace of an FSDP2 model with ``CPUOffloadPolicy`` what a GPU places on the
    host (Note 2). ``model``: the sharded fake model; ``optimizer``: the fake optimizer."""

    def __init__(self, model: nn.Module, optimizer):
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:     # a plain function: a parameter holds its hooks from C++, and
            p.register_post_accumulate_grad_hook(_grad_set)  # a bound method would hold this
            # placement, its optimizer and so every parameter, a cycle the gc cannot see

    def host_tensors(self) -> list[torch.Tensor]:
        """The parameters, their gradients and the optimizer state: host memory at the start."""
        out = list(self.params) + [p.grad for p in self.params if p.grad is not None]
        for state in self.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    @contextlib.contextmanager
    def step(self, on_phase):
        """Around one Runner step: yields the ``on_phase`` to give it; the forward and backward
        read host shards through device copies, the optimizer phase allocates on the host."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(_HostReads(_fake_tracker))

            def mark(name: str) -> None:
                if name == "optimizer":
                    stack.enter_context(host_allocations())
                on_phase(name)
            yield mark


class _HostReads(TorchDispatchMode):
    """An op that reads host storages into new storages reads device copies of them (Note 2)."""

    def __init__(self, tracker_of):
        super().__init__()
        self.tracker_of = tracker_of

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracker = self.tracker_of()
        if tracker is None or host_allocations_open():
            return func(*args, **kwargs)
        if all(r.alias_info is not None for r in func._schema.returns):
            return func(*args, **kwargs)    # a view or an in-place op: no new device buffer
        ledger = tracker.ledger
        host, seen = 0, set()
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                for st in ledger.storages(x):
                    if st._cdata not in seen and ledger.is_host(st):
                        seen.add(st._cdata)
                        host += st.nbytes()
        if host == 0:
            return func(*args, **kwargs)
        sid = ledger.transient(host)
        try:
            return func(*args, **kwargs)
        finally:
            ledger.end_transient(sid)
