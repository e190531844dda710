"""``profile_step``: one canonical step on fakes, counted by the same ``Tracker`` as real runs.

Note 1 (steady state). Peak is defined over a steady-state step (step >= 2): the optimizer
state exists and the previous step's gradients are still alive when the step begins (the
step's first act, ``zero_grad(set_to_none=True)``, frees them). Before the counted step we
therefore give every trainable parameter a gradient and run one untracked ``optimizer.step``,
which creates the state exactly as the real first step does; an optimizer with
``first_step_state()`` (memfit's eager torchao step, whose update is about sixty ops a parameter)
makes that same state without the update, as torch's Adam and AdamW do by their ``_init_group``
(Note 6). An optimizer stepped in backward
(``steps_in_backward``: one per parameter, run by gradient hooks) frees each gradient as it
steps it, so its steady state starts with no gradient alive; an optimizer that moves each
gradient to the host (``offload_gradients``) starts it with them alive on the host only.

Note 2 (mode order). The fake mode is entered first, ``FidelityMode`` (fake outputs made to match
real kernels) next, and the counting mode on top, so the counter sees each op once, as the real run
does, with the outputs the real kernel would give, and not the decompositions the fake mode may run
underneath. A GradScaler in a user's step reads its inf check back, which the fidelity mode
answers "finite" (``trace.finite_grads``). transformers reads the batch's masks
where the real step does (``trace.known_values``). ``FakeDeepcopyMode`` copies a fake the step
deep-copies into the trace's own fake mode (``trace.fake``).

Note 3 (what the trace leaves). A random draw whose value the step reads is drawn
from torch's real generator (``trace.data_dependent``), and a step may draw from Python's or
numpy's (SpecAugment masks). The trace puts all three generators back as it found them, so an
estimate changes nothing a later real step draws. An op the trace cannot run, in the warm-up or
the step, is a ``TraceError`` that names the op and, for a value read back, the line that read
it (``read_site``): the step's own code, or the library code it called (an optimizer's step).
Nor does a trace leave its fakes in the model's own method caches (``trace._method_caches``).

Note 4 (parameters the step gives no gradient). A real step gives no gradient to a parameter
its loss does not reach (DINOv2's mask token without a mask, LED's global-attention projections
where no token attends globally, a conformer's unused convolutional position embedding), and
AdamW makes no state for one without a gradient: trained on this batch, such a parameter never
has either. The warm-up cannot know them before the step runs, so a traced step that left some
trainable parameter without a gradient (``Tracker.ungraded``) is traced again, its warm-up
leaving those without (``api._traced``): about twice the time, for such models only. Before,
their gradients and state were counted (LED +6.5%, Wav2Vec2-Conformer +1.5%, a model with a
large unused layer three times its real step). The step is this batch's, every step: a
parameter another batch would reach (an expert in a module of its own that no token of this
batch is routed to) is counted as this batch leaves it. transformers 5 holds a mixture's
experts in one parameter per layer, which every routed token reaches. A step that keeps its
gradient buffers (``zero_grad="keep-buffers"``) keeps the warm-up's zeros on such a parameter
too, so it is not told from one that got its gradient some other way, and stays counted.

Note 5 (a config without a field the model reads). A config.json saved without a field the
model's forward reads (``decoder_start_token_id`` of a T5 made from ``T5Config(...)``, which
transformers no longer defaults) fails as an ``AttributeError`` on the config inside the step;
it is refused as bad input that names the field and the file to set it in, not a traceback.
A sequence classifier whose config has no ``pad_token_id`` (a Qwen2 config written by hand)
refuses a batch of more than one row in transformers' words; the field and the file are added.

Note 6 (the state of torch's Adam without its update). ``Adam.step`` (and ``AdamW``'s, the
same code) makes each parameter's state in ``_init_group`` (``step``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad), then updates every parameter in the functional
``adam``: for the for-loop implementation about fifteen ops a parameter, as many as the counted
step's own, so the warm-up cost as much as the step it prepared (1.5 s of the 7B floor's 28 s).
The warm-up calls ``_init_group`` alone, on every group, under ``no_grad`` as ``step`` runs it:
the same tensors of the same sizes, dtypes, devices and layouts. What differs is values only:
``step`` is 0 where a first step leaves 1, and the moments are zeros (as a first step leaves
them for the zero gradients it is given). Where that could differ in more, the whole ``step``
runs: a subclass (it may make state elsewhere), hooks on the step (a hook may act on the
first step: optimizer offload moves the state), ``differentiable`` groups, or an
``_init_group`` whose arguments are not those of the torch this was written against.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException,
                                           UnsupportedOperatorException)
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from memfit.errors import TraceError
from memfit.measure import ModuleRecord, Tracker
from memfit.measure._counting import op_name
from memfit.step import check_steppable
from memfit.trace.fake import FakeCopier, FakeDeepcopyMode
from memfit.trace.fidelity import FidelityMode
from memfit.trace.known_values import known_values_readable
from memfit.trace._method_caches import caches_cleared

__all__ = ["StepProfile", "profile_step", "profile_of", "warm_up_optimizer", "first_step_state_of",
           "makes_state_in_init_group", "read_site"]

_UNTRACEABLE = (DataDependentOutputException, UnsupportedOperatorException,
                DynamicOutputShapeException, NotImplementedError)


@dataclass
class StepProfile:
    """What one traced step does with memory. Bytes are storage bytes on the device."""

    peak_bytes: int
    breakdown: dict[str, int]                 # category -> bytes at the peak
    timeline: list[int]                       # live bytes after each op
    timeline_by_category: dict[str, list[int]]
    phases: dict[str, int]                    # phase name -> index of its first op
    modules: dict[str, ModuleRecord]          # qualified name -> record, in execution order
    fw_flops: int                             # forward FLOPs of the step
    bw_flops: int                             # backward FLOPs of the step
    num_ops: int
    op_log: list[str]                         # the aten op behind each timeline point
    trace_seconds: float                      # wall time of the traced step
    host_peak_bytes: int = 0                  # memfit's host pool (offload), apart from the device
    blocks: list[str] = field(default_factory=list)
    # per op: FLOPs, bytes touched, of which training state, bytes allocated (measure._counting)
    op_costs: list[tuple[int, int, int, int]] = field(default_factory=list)
    start_breakdown: dict[str, int] = field(default_factory=dict)   # before the first op


def warm_up_optimizer(model: nn.Module, optimizer, skip=frozenset()) -> None:
    """Create optimizer state and leave gradients alive, as after a first step (Note 1);
    ``skip``: names of parameters the step gives no gradient (Note 4), left without."""
    check_steppable(optimizer)
    params = [p for name, p in model.named_parameters() if p.requires_grad and name not in skip]
    for name, p in model.named_parameters():     # a fake copied again keeps its gradient
        if name in skip:
            p.grad = None
    grads = []
    for p in params:
        p.grad = torch.zeros_like(p)
        grads.append((p.grad, p.grad.untyped_storage().nbytes()))
    make = first_step_state_of(optimizer)
    make()                    # the state without the update's ops where it can
    if getattr(optimizer, "steps_in_backward", False):
        return                 # its step freed them, as its hooks do in every backward
    if getattr(optimizer, "offload_gradients", False):
        return                 # its step moved them to the host, where they stay alive
    if make != optimizer.step and all(p.grad is g and g.untyped_storage().nbytes() == n
                                      for p, (g, n) in zip(params, grads)):
        return                 # the state made without a step, the gradients untouched: kept
    for p in params:           # the previous step's gradients, alive at the next step's start
        p.grad = torch.zeros_like(p)


_ADAM_LISTS = ("params_with_grad", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
               "state_steps")


def makes_state_in_init_group(optimizer) -> bool:
    """Whether ``optimizer`` is torch's Adam or AdamW making its state in ``_init_group`` as
    this torch does, nothing on its step that could act on the first one (Note 6)."""
    init = getattr(type(optimizer), "_init_group", None)
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and init is not None and \
        not (optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or
             _global_optimizer_pre_hooks or _global_optimizer_post_hooks) and \
        tuple(inspect.signature(init).parameters)[2:] == _ADAM_LISTS and \
        not any(g.get("differentiable") for g in optimizer.param_groups)


def first_step_state_of(optimizer) -> Callable[[], object]:
    """What makes ``optimizer``'s state as its first step does (Note 6): its own
    ``first_step_state``, torch's Adam/AdamW's ``_init_group``, else a whole ``step``."""
    make = getattr(optimizer, "first_step_state", None)
    if callable(make):
        return make
    if not makes_state_in_init_group(optimizer):
        return optimizer.step

    def init_groups():
        with torch.no_grad():
            for group in optimizer.param_groups:
                optimizer._init_group(group, *([] for _ in _ADAM_LISTS))
    return init_groups


def profile_step(run_step: Callable[[Callable[[str], None]], object], *, copier: FakeCopier,
                 model: nn.Module, optimizer, warm_up: Callable[[], object] | None = None,
                 two_steps: bool = False, on_state: Callable[[Tracker], None] | None = None,
                 blocks: list[str] | None = None, skip=frozenset()
                 ) -> tuple[StepProfile, Tracker]:
    """Trace ``run_step(on_phase)`` on fakes made by ``copier`` and count it.

    ``model`` and ``optimizer`` are the fake ones the step uses; they are counted from the start
    (parameters, gradients, optimizer state) and sort the bytes into categories. ``warm_up``
    runs first, uncounted, to reach the steady state (default: ``warm_up_optimizer``, Note 1).
    ``two_steps``: instead, count two whole steps and take the peak over the second (an
    allocator replay needs the first step's history). ``on_state(tracker)`` runs once the
    optimizer state exists: before the counted step, or between the two.
    ``blocks``: the model's block names, for a tracker that labels storages with them
    (``trace.block_reuse``). ``skip``: parameters the default warm-up leaves without a
    gradient or state (Note 4).
    """
    with (caches_cleared(model), copier.mode, FidelityMode(copier.data),
          known_values_readable(copier.data),
          FakeDeepcopyMode(copier.mode), _generators_kept()):
        if not two_steps:            # two steps need no warm-up: step 1 is it
            try:
                (warm_up or (lambda: warm_up_optimizer(model, optimizer, skip)))()
            except _UNTRACEABLE as e:                     # Note 3
                raise _trace_error(e, None) from e
        tracker = Tracker(model=model, optimizer=optimizer, device=copier.device, fake=True,
                          blocks=blocks)
        phases: dict[str, int] = {}
        start = time.perf_counter()
        try:
            with tracker:
                if two_steps:
                    run_step(lambda name: None)
                if on_state is not None:
                    on_state(tracker)
                if two_steps:
                    tracker.start_window()
                first_op = tracker.ops
                run_step(lambda name: phases.setdefault(name, tracker.ops - first_op))
        except _UNTRACEABLE as e:
            raise _trace_error(e, tracker) from e
        except AttributeError as e:
            missing = _missing_config_field(e, model)
            if missing is None:
                raise
            raise missing from e
        except ValueError as e:
            if "no padding token is defined" not in str(e):
                raise
            raise ValueError(                                     # Note 5
                f"{e} ({type(model).__name__} finds each row's last token by the config's "
                "pad_token_id, which this config leaves unset): add \"pad_token_id\": <id> to "
                "its config.json (the tokenizer's pad id, or its eos id where it has none)"
            ) from e
        seconds = time.perf_counter() - start
    return profile_of(tracker, phases, seconds), tracker


def profile_of(tracker: Tracker, phases: dict[str, int], seconds: float) -> StepProfile:
    """The ``StepProfile`` of a finished tracker (traced, or composed by ``trace.block_reuse``)."""
    records = sorted((r for r in tracker.modules.values() if r.order >= 0), key=lambda r: r.order)
    return StepProfile(
        peak_bytes=tracker.peak_bytes,
        breakdown=tracker.breakdown,
        timeline=tracker.timeline,
        timeline_by_category=tracker.timeline_by_category,
        phases=phases,
        modules={r.name: r for r in records},
        fw_flops=tracker.fw_flops,
        bw_flops=tracker.bw_flops,
        num_ops=tracker.ops,
        op_log=[op_name(op) for op in tracker.window_op_log],
        trace_seconds=seconds,
        host_peak_bytes=tracker.host_peak_bytes,
        blocks=[r.name for r in records if r.is_block],
        op_costs=tracker.window_op_costs,
        start_breakdown=tracker.start_breakdown,
    )


@contextlib.contextmanager
def _generators_kept():
    """Note 3: torch's CPU generator, Python's and numpy's, as they were before the trace."""
    state = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(state[0])
        random.setstate(state[1])
        np.random.set_state(state[2])


_MACHINERY = (Path(torch.__file__).parent, Path(__file__).parents[1])   # torch, memfit


def read_site(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``e``'s traceback outside torch's dispatch machinery and memfit:
    the code that asked for the op (Note 3); torch's own modules (``torch/optim``, ``torch/nn``)
    count as code, its private ones (``torch/_*``, ``torch/utils/_*``) do not."""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = Path(frame.filename)
        if path.is_relative_to(_MACHINERY[1]):
            continue
        if path.is_relative_to(_MACHINERY[0]):
            parts = path.relative_to(_MACHINERY[0]).parts
            if parts[0].startswith("_") or (parts[0] == "utils" and parts[1].startswith("_")):
                continue
        return frame
    return None


def describe_site(frame: traceback.FrameSummary) -> str:
    """``package/file.py:line in function: `source``` for a frame from ``read_site``."""
    parts = Path(frame.filename).parts
    installed = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
    short = Path(*parts[installed[-1] + 1:]) if installed else Path(frame.filename)
    line = f": `{frame.line.strip()}`" if frame.line else ""
    return f"{short}:{frame.lineno} in {frame.name}{line}"


def _missing_config_field(e: AttributeError, model: nn.Module) -> ValueError | None:
    """Note 5: a field the model's forward reads off a config that does not set it."""
    config = getattr(model, "config", None)
    said = re.fullmatch(r"'(\w+)' object has no attribute '(\w+)'", str(e))
    if config is None or said is None or said[1] != type(config).__name__:
        return None             # transformers raises it itself: no ``obj`` to read
    name = said[2]
    site = next((f for f in reversed(traceback.extract_tb(e.__traceback__))
                 if "modeling_" in Path(f.filename).name), None)     # the model's own line
    where = f" ({describe_site(site)})" if site is not None else ""
    return ValueError(
        f"the model's {said[1]} has no {name!r}, which {type(model).__name__}'s step "
        f"reads{where}: add \"{name}\": <value> to its config.json (the model's published "
        "config sets it; for a decoder's start token, the pad token's id is what T5 and BART "
        "use)")


def _trace_error(e: Exception, tracker: Tracker | None) -> TraceError:
    op = tracker.failed_op if tracker is not None else None
    op = op or (str(e.func) if hasattr(e, "func") else None)
    module = tracker.failed_module if tracker is not None else None
    where = f" in module '{module}'" if module else ""
    stage = "" if tracker is not None else " in the optimizer's warm-up step (no forward)"
    site = read_site(e)
    if op is not None and "_local_scalar_dense" in str(op):
        at = f" at {describe_site(site)}" if site is not None else ""
        return TraceError(
            f"the fake trace cannot read a tensor's value{stage}{where}{at} (.item(), bool(), "
            "float(), a tensor in an if): it knows the batch's integer and bool tensors, the "
            "numbers the step makes (step counts, random draws), scalar summaries of a real "
            "model's weights (not of a model on the meta device), and what is computed from "
            "those alone; this value comes from elsewhere (activations, gradients, updated "
            "state). Measure the real step with memfit.track instead (in Python, a loss_fn or "
            f"step that avoids the read also works). ({type(e).__name__}: {e})",
            op=op, module=module)
    return TraceError(
        f"the fake trace cannot run {op or 'an op'}{stage}{where}: {type(e).__name__}: {e}. "
        "This op needs real data the trace does not have (data-dependent ops are resolved "
        "from the batch's integer and bool tensors, not from float ones or values computed "
        "from the weights) or has no fake implementation. Measure the real step with "
        "memfit.track instead (in Python, a loss_fn that avoids the op also works).",
        op=op, module=module,
    )
