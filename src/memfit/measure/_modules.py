"""Which module is running: forward and backward windows, innermost module, per-module records.

Forward is followed with per-module hooks on the tracked model (``with_kwargs`` so that keyword
inputs count as inputs). Backward is followed the way PyTorch's ``ModTracker`` does it, with
multi-grad hooks on module outputs ("any": the module's backward starts) and on its inputs,
keywords included ("all": it ends; a module without such inputs ends with the backward pass,
Note 5), so it adds no tensors and changes no memory; but the hooks are memfit's own, so that
they can be removed (Note 1).

Note 1 (nothing kept alive). A multi-grad "all" hook closes over the autograd nodes of the
tensors it watches, and it is stored on those same nodes, from C++: node -> hook -> node is a
cycle the garbage collector cannot see (an "any" hook holds no node; on one tensor the two
modes are the same, so one input is watched with "any"), so ``ModTracker``'s hooks, never removed, kept every
graph they touched alive for good, and through its ``AccumulateGrad`` nodes every parameter
(a traced model's fakes after ``estimate``, the user's model after ``track``), and inside the
region a forward that raised kept its activations (an OOM guard's retry had less room). Here
each registration keeps its handle: the handles whose hooks fired are removed by a callback at
the end of that backward pass; a call whose outputs need no gradient (a forward that raised
among them: ``always_call`` hooks see no output) has its input hook removed at once; all others
go when the watch exits. The hooks reach the watch through a weak reference, so a graph that
outlives the region keeps nothing of memfit's alive.

Note 2 (deep copies). ``estimate`` deep-copies a model to trace it (``trace.fake``), hooks
included; a model tracked by an enclosing ``track`` carries this watch's hooks. Copying the
watch with it would copy the outer tracker (and its model). A watch is therefore its own deep
copy: on the copy's modules its hooks find no name and do nothing.

Note 3 (several passes). A step that runs a module more than once (micro-batches accumulated
inside a user's step, an extra forward) has one span per forward call and per backward, and the
saved bytes of each call (each storage once per call; ``saved_bytes`` counts each storage once
in all). ``fw_span`` / ``bw_span`` are the last forward and the first backward, as before.
Forward calls during a backward (a checkpoint's recompute) are not calls: the hooks skip them.

Note 4 (a module that returns its input). A call that returns its inputs as they came (a
dropout of ``p=0``, an identity) runs nothing in backward. Watched as the others, its end
(the gradient of its input) and its start (the gradient of its output: the same tensor) would
fire together, end first, and leave it on the stack of running modules for the rest of the
region: every tensor later saved was charged to it, so its totals grew with the model's depth.
Its backward is not watched.

Note 5 (keyword inputs). transformers calls a block's attention as ``self_attn(hidden_states=...)``.
Watching the positional inputs alone (as ``ModTracker`` does) left such a module without any, so
its backward "ended with the pass": every attention's backward span ran to the end of backward,
and where nothing runs after the first block's backward (a LoRA model: the embeddings frozen)
those ends landed inside block 0's, a run of references to every block that kept a deep
model's step from composing from twins (``trace.block_reuse``). Its end is now the gradient of
every tensor input that needs one, however it was passed. So a module given a tensor that
others read too ends when that tensor's whole gradient is done, as a block always did: a BART
decoder layer's cross-attention, given the encoder's output as ``key_value_states``, ends
when the last layer's contribution to it is summed.

Note 6 (several inputs). torch's "all" multi-grad hook keeps each gradient until the last
arrives (a cross-attention's, given the encoder's output, held the early one that long); the
end is watched by ``measure._grad_hooks.when_all_gradients``, which counts and holds none.
"""

from __future__ import annotations

import bisect
import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from memfit.measure._compile_aware import watched_modules
from memfit.measure._grad_hooks import when_all_gradients
from memfit.measure._ledger import storages_of
from memfit.measure._sizes import hint


@dataclass
class ModuleRecord:
    """What one module did during the tracked region. Bytes are storage bytes on the device."""

    name: str                 # qualified name in the model ("" for the root)
    type: str                 # class name
    order: int                # position of its first forward call among all modules
    calls: int = 0            # forward calls
    param_bytes: int = 0      # its parameters (and sub-modules'), each storage once
    input_bytes: int = 0      # tensor inputs of its first forward call (what a checkpoint keeps)
    saved_bytes: int = 0      # bytes autograd saved for backward inside it (each storage once)
    fw_flops: int = 0         # forward FLOPs inside it (matmul/conv/attention, FlopCounter rules)
    bw_flops: int = 0         # backward FLOPs inside it
    fw_touched_bytes: int = 0  # bytes its forward ops read and wrote (tensor inputs + outputs)
    bw_touched_bytes: int = 0  # the same for its backward (recompute included)
    fw_ops: int = 0           # aten ops its forward ran (each a kernel launch on a GPU)
    bw_ops: int = 0
    fw_span: tuple[int, int] | None = None  # first and last op index of its (last) forward
    bw_span: tuple[int, int] | None = None  # ... and of its (first) backward, in timeline ops
    fw_spans: list = field(default_factory=list)   # every forward call's span, by start (Note 3)
    bw_spans: list = field(default_factory=list)   # every backward's span, by start
    call_saved_bytes: list = field(default_factory=list)  # saved bytes of each forward call
    fw_peak_bytes: int = 0    # live bytes peak while its forward ran (whole device, not only its own)
    bw_peak_bytes: int = 0    # live bytes peak while its backward ran
    is_block: bool = False    # one of the model's repeated layers (see ``find_blocks``)
    _saved: set = field(default_factory=set, repr=False)
    _call_saved: set = field(default_factory=set, repr=False)


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the model's repeated layers.

    transformers' ``GradientCheckpointingLayer`` instances where present, else the children of
    the largest ``ModuleList``/``Sequential`` whose children all have the same type.
    """
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # older transformers
        GradientCheckpointingLayer = None
    if GradientCheckpointingLayer is not None:
        names = [n for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
        # keep only the outermost ones
        names = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]
        if names:
            return names
    best: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > len(best):
            kinds = {type(c) for c in m}
            if len(kinds) == 1:
                best = [f"{name}.{k}" if name else k for k, _ in m.named_children()]
    return best


class ModuleWatch:
    """Keeps the stack of running modules and a record per module of the tracked model."""

    def __init__(self, model: nn.Module | None, on_enter, on_exit):
        self.model = model
        self.records: dict[str, ModuleRecord] = {}
        self.stack: list[str] = []      # running modules, outermost first
        self._names: dict[int, str] = {}
        self._on_enter = on_enter       # (name, phase) -> None; phase is "fw" or "bw"
        self._on_exit = on_exit
        self._handles = []
        self._bw_handles: dict[int, object] = {}   # registration -> its multi-grad hook handle
        self._bw_fired: list[int] = []             # registrations fired in this backward pass
        self._bw_no_inputs: list[str] = []         # modules whose backward ends with the pass
        self._calls: dict[int, list] = {}          # id(module) -> its running calls' input hooks
        self._bw_pass = False                      # a backward pass is being followed
        self._bw_removal = False                   # its end-of-pass removal is queued
        self._next_key = 0
        self._open = False
        if model is not None:
            for name, m in watched_modules(model, remove_duplicate=False):
                self._names.setdefault(id(m), name)

    def __deepcopy__(self, memo):
        return self          # Note 2

    @property
    def innermost(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def name_of(self, m: nn.Module | None) -> str | None:
        return None if m is None else self._names.get(id(m))

    def __enter__(self):
        if self.model is None:
            return self
        blocks = set(find_blocks(self.model))
        for name, m in watched_modules(self.model):    # a compiled region: its wrapper
            self._handles.append(m.register_forward_pre_hook(self._pre_fw, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post_fw, always_call=True))
            self._handles.append(m.register_forward_pre_hook(self._bw_pre_fw, prepend=True,
                                                             with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._bw_post_fw, prepend=True,
                                                         always_call=True))
            rec = self.records.setdefault(name, ModuleRecord(name, type(m).__name__, order=-1))
            rec.is_block = name in blocks
            rec.param_bytes = _unique_bytes(m.parameters())
        self._open = True
        return self

    def __exit__(self, *exc):
        if not self._open:
            return
        self._open = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for h in self._bw_handles.values():      # Note 1
            h.remove()
        self._bw_handles.clear()
        self._bw_fired.clear()
        self._bw_no_inputs.clear()
        self._calls.clear()
        self._bw_pass = self._bw_removal = False
        self.model = None                         # the records stay; the model is the user's

    # forward: hooks on the tracked model's own modules
    def _pre_fw(self, m, args, kwargs):
        name = self._names.get(id(m))
        if name is None or torch._C._current_graph_task_id() != -1:
            return
        rec = self.records[name]
        if rec.order < 0:
            rec.order = sum(r.order >= 0 for r in self.records.values())
        if rec.calls == 0:
            rec.input_bytes = _unique_bytes(tree_flatten((args, kwargs))[0])
        rec.calls += 1
        rec.call_saved_bytes.append(0)
        rec._call_saved = set()
        self.stack.append(name)
        self._on_enter(name, "fw")

    def _post_fw(self, m, args, output):
        name = self._names.get(id(m))
        if name is None or torch._C._current_graph_task_id() != -1:
            return
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
            self._on_exit(name, "fw")

    # backward: multi-grad hooks on what the module is called with and returns, placed before
    # any other hook of the module may replace them (as ModTracker's global hooks are)
    def _bw_pre_fw(self, m, args, kwargs):
        name = self._names.get(id(m))
        if name is None or torch._C._current_graph_task_id() != -1:
            return
        inputs = [a for a in tree_flatten((args, kwargs))[0]     # Note 5: keywords too
                  if isinstance(a, torch.Tensor) and a.requires_grad]
        key = None
        if inputs:    # one tensor: "any" is "all" and holds no node (Note 1)
            key = self._watch_backward(inputs, name, _ended, "all" if len(inputs) > 1 else "any")
        else:
            self._bw_no_inputs.append(name)
        self._calls.setdefault(id(m), []).append((key, {id(a) for a in inputs}))

    def _bw_post_fw(self, m, args, output):
        name = self._names.get(id(m))
        if name is None or torch._C._current_graph_task_id() != -1:
            return
        calls = self._calls.get(id(m))
        key, inputs = calls.pop() if calls else (None, set())
        outputs = [a for a in tree_flatten(output)[0]
                   if isinstance(a, torch.Tensor) and a.requires_grad]
        if outputs and not all(id(a) in inputs for a in outputs):
            self._watch_backward(outputs, name, _started, "any")
            return
        # no output needs a gradient (or the forward raised, Note 1), or each is an input
        # returned as it came (a dropout of p=0: its end would fire before its start, and the
        # module would stay "running" for good, Note 4): no backward of this call will start,
        # so nothing is to be watched for its end
        if key is not None:
            self._bw_handles.pop(key).remove()
        elif name in self._bw_no_inputs:
            idx = len(self._bw_no_inputs) - 1 - self._bw_no_inputs[::-1].index(name)
            del self._bw_no_inputs[idx]

    def _watch_backward(self, tensors, name: str, hook, mode: str) -> int:
        key = self._next_key
        self._next_key += 1
        fn = functools.partial(hook, weakref.ref(self), key, name)      # Note 1: weak
        self._bw_handles[key] = register_multi_grad_hook(tensors, fn, mode="any") \
            if mode == "any" else when_all_gradients(tensors, fn)    # Note 6: holds none
        return key

    def _begin_pass(self) -> None:
        """A module's backward starts; on the pass's first, queue the ends of the modules that
        had no input needing a gradient (they end with the pass)."""
        if self._bw_pass:
            return
        self._bw_pass = True
        queue = torch.autograd.Variable._execution_engine.queue_callback
        for name in reversed(self._bw_no_inputs):
            queue(functools.partial(self._post_bw, name))
        self._bw_no_inputs.clear()
        queue(self._end_pass)

    def _end_pass(self) -> None:
        self._bw_pass = False

    def _fired(self, key: int) -> None:
        self._bw_fired.append(key)
        if not self._bw_removal:
            self._bw_removal = True
            torch.autograd.Variable._execution_engine.queue_callback(self._remove_fired)

    def _remove_fired(self) -> None:
        """End of a backward pass: remove the hooks that fired in it (Note 1)."""
        self._bw_removal = False
        for key in self._bw_fired:
            h = self._bw_handles.pop(key, None)
            if h is not None:
                h.remove()
        self._bw_fired.clear()

    def _pre_bw(self, name: str) -> None:
        self.stack.append(name)
        self._on_enter(name, "bw")

    def _post_bw(self, name: str) -> None:
        if name in self.stack:
            # backward does not always nest cleanly: remove the latest entry of this module
            idx = len(self.stack) - 1 - self.stack[::-1].index(name)
            del self.stack[idx]
            self._on_exit(name, "bw")

    def reset_counts(self) -> None:
        """Forget calls, inputs, saved bytes and FLOPs (a new window starts); keep the order."""
        for rec in self.records.values():
            rec.calls = rec.saved_bytes = rec.fw_flops = rec.bw_flops = 0
            rec.fw_touched_bytes = rec.bw_touched_bytes = rec.fw_ops = rec.bw_ops = 0
            rec.fw_span = rec.bw_span = None
            rec.fw_spans, rec.bw_spans, rec.call_saved_bytes = [], [], []
            rec.input_bytes = 0
            rec._saved, rec._call_saved = set(), set()

    def saved(self, storage, sid: int, nbytes: int) -> None:
        """Attribute a storage saved for backward to every module now running forward."""
        for name in self.stack:
            rec = self.records[name]
            if sid not in rec._saved:
                rec._saved.add(sid)
                rec.saved_bytes += nbytes
            if sid not in rec._call_saved and rec.call_saved_bytes:
                rec._call_saved.add(sid)
                rec.call_saved_bytes[-1] += nbytes

    def flops(self, n: int, backward: bool) -> None:
        for name in self.stack:
            rec = self.records[name]
            if backward:
                rec.bw_flops += n
            else:
                rec.fw_flops += n

    def touched(self, nbytes: int, backward: bool) -> None:
        """One op ran, reading and writing ``nbytes``, inside every module now running."""
        for name in self.stack:
            rec = self.records[name]
            if backward:
                rec.bw_touched_bytes += nbytes
                rec.bw_ops += 1
            else:
                rec.fw_touched_bytes += nbytes
                rec.fw_ops += 1


def _started(ref, key: int, name: str, grad) -> None:
    """A module's backward starts: the first gradient of one of its outputs."""
    watch = ref()
    if watch is not None and watch._open:
        watch._begin_pass()
        watch._fired(key)
        watch._pre_bw(name)


def _ended(ref, key: int, name: str, grad=None) -> None:
    """A module's backward ends: every gradient of its inputs that this pass computes."""
    watch = ref()
    if watch is not None and watch._open:
        watch._fired(key)
        watch._post_bw(name)


def finish_records(records: dict[str, ModuleRecord], windows, resolved, ops: list[int],
                   window_event: int) -> None:
    """Each record's peaks and spans from its windows ``(name, phase, first event, last
    event)``: the live-bytes peak over each (``resolved``, the ledger's) and, for a window in
    the counted step (from ``window_event``), its span in the timeline's ops (``ops``: the
    ledger's event count after each of them)."""
    for name, phase, start, stop in windows:
        rec = records.get(name)
        if rec is None:
            continue
        peak = resolved.max_between(start, stop)
        span = None
        if start >= window_event:      # op indices of the timeline (window)
            span = (bisect.bisect_right(ops, start), bisect.bisect_right(ops, stop + 1) - 1)
        if phase == "fw":
            rec.fw_peak_bytes = max(rec.fw_peak_bytes, peak)
            rec.fw_span = span or rec.fw_span          # the last forward call
            if span:
                rec.fw_spans.append(span)
        else:
            rec.bw_peak_bytes = max(rec.bw_peak_bytes, peak)
            if rec.bw_span is None:                    # the first backward
                rec.bw_span = span
            if span:
                rec.bw_spans.append(span)
    for rec in records.values():   # one span per call of a module run twice
        rec.fw_spans.sort()
        rec.bw_spans.sort()


def _unique_bytes(items) -> int:
    seen, total = set(), 0
    for t in items:
        if isinstance(t, torch.Tensor):
            for st in storages_of(t):
                if st._cdata not in seen:
                    seen.add(st._cdata)
                    total += hint(st.nbytes())
    return total
