"""Gradients autograd sums in place, counted as a run without a dispatch mode makes them.

Note 1 (the engine's rule). When a tensor's gradient has several contributions (a tensor used
twice, a residual stream, a tied weight), the autograd engine sums them in the input buffer of
the node that consumes it (``torch/csrc/autograd/input_buffer.cpp``, ``accumulate``): the
first contribution waits there, and each later one is added as ``old.add_(new)``, in place,
when grad mode is off and ``old`` is a plain dense tensor whose last reference the buffer
holds (its use count and its storage's are one: not a view, whose base holds the storage too,
as the transposed weight gradient of a ``Linear`` and a gradient reshaped back to its input's
shape are); else as ``old + new``, a third buffer. A
``TorchDispatchMode`` turns the in-place path off: ``at::isTensorSubclassLike`` answers yes for
every tensor while a mode is active, and a fake tensor is a subclass anyway. So ``track`` and
the trace, PyTorch's ``MemTracker`` too, saw ``old + new`` where a run without them adds in
place, and counted one gradient-sized buffer more at every such sum (+1.06% on DINOv2, +30% on
a miniature of its classifier, +0.5% on BART; docs/measurement.md).

Note 2 (which adds are the engine's). The engine adds a node's outputs into the buffers of the
nodes they feed after the node's post hooks ran (``engine.cpp``: ``call_function``, then
``InputBuffer::add`` per output), with the node still the current one
(``torch._C._current_autograd_node``). So every node of the graph gets a post hook when
backward first runs an op of it (walked from that node), which opens a window; an
``aten.add.Tensor`` in the window, with the same node current, is the engine's sum, and any
other op closes it. A node is known by its sequence number and name (its Python object is made
anew each time it is asked for; holding it would keep the node, and whatever its function
stored, alive past the point the engine frees it). The hooks are removed when backward ends.

Note 3 (its last reference). Whether the buffer held ``old``'s last reference is seen rather
than guessed: the engine drops ``old`` as the sum replaces it, so ``old``'s storage dies at once
if nothing else holds it (a hook that kept the gradient, another buffer with the same tensor, a
view of its storage), before any other op or event. The ledger then counts the sum as ``old``
itself (``Ledger.expect_in_place``: the sum's birth and ``old``'s death are taken back, and
``old``'s bytes live until the sum dies), as the in-place add would have kept them. Where
something else held it, the sum was out of place in a run without a mode too, and stays so.

Note 4 (a hook that would keep gradients alive). A node with a post hook is called on a copy of
its incoming gradients, the engine keeping the originals to hand the hook (``engine.cpp``,
``call_function``). A C++ node holds them until it returns anyway, so for it nothing changes. A
Python function whose class sets ``boxed_grads_call`` (AOTAutograd's compiled backward) is given
its gradients in a list it empties, and its generated code frees each one as soon as it has read
it (``del tangents_1``); the engine's copy kept them to the end of the node. On a per-block
compiled llama, each block's backward held its output's gradient through the attention's
backward: +16,384 B at the step's peak, 1%. Such a node gets no hook (the nodes below it still
do), so an engine sum of its outputs is counted out of place, as any mode sees it. A compiled
region's outputs rarely need one: a block's output feeds the next block alone.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["GradSums"]

_ADD = torch.ops.aten.add.Tensor
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


def _key(node) -> tuple[int, str]:
    return node._sequence_nr(), node.name()


class GradSums:
    """The engine's gradient sums of one tracker's region (module docstring)."""

    def __init__(self):
        self._hooked: set[tuple[int, str]] = set()
        self._handles: list = []
        self._local = threading.local()   # the window, per thread: a GPU's backward runs
                                          # its nodes on a device thread beside the CPU's

    @property
    def _window(self) -> tuple[int, str] | None:
        return getattr(self._local, "window", None)

    @_window.setter
    def _window(self, key: tuple[int, str] | None) -> None:
        self._local.window = key

    def in_place_sum(self, func, args, kwargs, out, backward: bool) -> torch.Tensor | None:
        """``old`` where this op (just run; ``backward``: inside a backward pass) is the
        engine's sum of ``old`` and a new contribution that a run without a mode adds in place
        (Note 1), if ``old`` is the last holder of its storage (the caller's ledger sees that,
        Note 3); else None. Call it after every op."""
        if not backward:
            if self._hooked:
                self.close()
            return None
        node = torch._C._current_autograd_node()
        if node is None:
            self._window = None
            return None
        key = _key(node)
        if key not in self._hooked:
            self._hook_from(node)
        if key != self._window:
            self._window = None
            return None
        if func is not _ADD or kwargs or len(args) != 2 or torch.is_grad_enabled():
            return None
        old, new = args
        if type(old) not in _PLAIN or type(new) not in _PLAIN or not isinstance(out, torch.Tensor):
            return None
        if old.layout is not torch.strided or new.layout is not torch.strided or \
                old._is_view() or old._is_zerotensor() or old.is_nested or \
                old.dtype != out.dtype or \
                old.shape != out.shape or not is_non_overlapping_and_dense_or_false(old):
            return None
        return old

    def _hook_from(self, root) -> None:
        """A post hook on ``root`` and every node below it not hooked yet (Note 2)."""
        ref = weakref.ref(self)
        stack = [root]
        while stack:
            node = stack.pop()
            key = _key(node)
            if key in self._hooked:
                continue
            self._hooked.add(key)
            nexts = [n for n, _ in node.next_functions if n is not None]
            # a node that feeds none (AccumulateGrad) sums nothing after it; one given its
            # gradients boxed frees them early, which a hook would stop (Note 4)
            if nexts and not _boxed(node):
                self._handles.append(node.register_hook(_opener(ref, key)))
            stack += nexts

    def close(self) -> None:
        """Remove the hooks (backward is over, or the region is)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()
        self._window = None


def _boxed(node) -> bool:
    """Whether autograd hands ``node`` its gradients in a list it may empty (Note 4)."""
    return bool(getattr(getattr(node, "_forward_cls", None), "boxed_grads_call", False))


def _opener(ref, key):
    def opened(grad_inputs, grad_outputs):
        sums = ref()
        if sums is not None:
            sums._window = key
    return opened
