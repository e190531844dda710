"""A hook that runs once every gradient of some tensors is computed, holding none of them.

Note 1 (why not torch's). ``torch.autograd.graph.register_multi_grad_hook(mode="all")`` hands
its function the gradients, so it keeps each one, as it arrives, in a buffer until the last
arrives. A module's backward ends when the gradients of all its inputs are done
(``measure._modules``), and an input that other modules read too gets its whole gradient only
when the last of them has run: a BART decoder layer's cross-attention reads the encoder's
output, whose gradient is summed over every decoder layer. The buffer kept that attention's
other input gradient (3,072 B in a tiny BART) alive through the rest of the decoder's backward,
where a run without the hook frees it at once: BART's estimate and ``track`` were 3,056 B
(0.4%) above the real step. Here each tensor's hook only counts: the function runs, with no
gradient, when as many have fired as the engine will run of their nodes in this backward
(``_will_engine_execute_node``, asked at the first, as torch's own "all" mode asks it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from torch.autograd.graph import _get_grad_fn_or_grad_acc

__all__ = ["when_all_gradients"]


class _Handles:
    def __init__(self, handles: list):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def when_all_gradients(tensors: Sequence[torch.Tensor], fn: Callable[[], None]) -> _Handles:
    """Run ``fn()`` in each backward once the gradient of every tensor of ``tensors`` that
    the backward computes is done, keeping no gradient (Note 1); ``.remove()`` the handle."""
    nodes = [_get_grad_fn_or_grad_acc(t) for t in tensors]
    fired: dict[int, int] = {}          # per backward (graph task): hooks fired, hooks due
    due: dict[int, int] = {}
    lock = threading.Lock()

    def counted(grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in due:
                due[task] = sum(map(torch._C._will_engine_execute_node, nodes))
            fired[task] = fired.get(task, 0) + 1
            done = fired[task] == due[task]
            if done:
                del fired[task], due[task]
        if done:
            fn()

    return _Handles([t.register_hook(counted) for t in tensors])
