"""``memfit.estimate``: the memory of one steady-state training step, without running it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from memfit.api import _trace_cache as trace_cache
from memfit.api._blockwise import TOO_FEW, blockwise_estimate
from memfit.api._estimate_result import Estimate
from memfit.api._rank_layout import RankLayout
from memfit.api._traced import figures, phase_alone, trace_step
from memfit.api._validate import check_order
from memfit.knobs import Knobs
from memfit.trace import FakeCopier
from memfit.trace.allocator import AllocatorConfig
from memfit.trace.collector import old_objects_frozen

__all__ = ["Estimate", "estimate"]


@old_objects_frozen()      # no full collection walks what was there before (trace.collector)
def estimate(model: nn.Module, batch, optimizer="adamw", device=None,
             loss_fn: Callable | None = None, *, budget=None, count_fn: Callable | None = None,
             allocator: AllocatorConfig | None = None, allocator_replay: bool = True,
             step: Callable | None = None, scheduler: Callable | None = None,
             cuda_version=None, compose_blocks: bool = True, optimizer_only: bool = False,
             **knobs) -> Estimate:
    """Predict the memory of one steady-state training step of ``model`` on ``batch``.

    Traces zero_grad -> forward -> loss -> backward -> optimizer.step on fake tensors (no real
    memory, no real compute); ``model`` may be real or on the ``meta`` device and is not
    touched. ``optimizer``: a name ("adamw", "sgd", ...), an instance, or a factory
    ``params -> Optimizer``. ``device``: a GPU name ("gtx-1080-ti"), "cpu" or a ``DeviceSpec``
    (default: where the model is). ``budget`` (bytes or "11GiB") replaces the device's usable
    memory as the limit ``fits`` checks. Knobs (``memfit.Knobs``): ``precision``,
    ``micro_batch_size`` (the peak of the whole accumulated effective batch), ``max_grad_norm``,
    ``checkpoint``, ``offload``, ``offload_optimizer`` (host bytes in ``host_peak_bytes``),
    ``remat`` (with ``budget``: DTR simulated on the traced step, ``remat_*`` fields; the
    traced figures stay those of the plain step), ``zero_grad`` (the loop style: "before-forward",
    the default, "after-forward" or "keep-buffers", ``memfit.step``), ``optimizer_state``
    ("8bit": bitsandbytes', "bf16", "4bit": torchao's low-bit Adam/AdamW,
    ``techniques.low_bit_optimizer``),
    ``offload_params`` (block weights on the host, with ``offload_optimizer``,
    ``techniques.param_offload``), ``optimizer_in_backward`` (each parameter stepped, and its
    gradient freed, in backward: ``techniques.optimizer_in_backward``); ``count_fn`` as in
    ``fit``.
    For a GPU the CPU trace is run through models of CUDA's autocast, attention kernels,
    optimizer defaults and caching allocator (``allocator``: its settings, e.g.
    ``AllocatorConfig(expandable_segments=True)``), see ``memfit.trace.cuda``.
    ``allocator_replay=False`` skips that replay (one traced step instead of two: allocated
    bytes only, reserved taken equal to them), for callers that only need the timeline.
    ``cuda_version`` ("12", "12.4"): the CUDA whose context and kernels the card figure counts
    (default: what the installed torch was built for; a CPU wheel assumes 12.8 and says so in
    ``notes``); ``device`` may also be a profile from ``memfit calibrate`` (FILE.json or
    ``DeviceSpec.load``), whose measured figures are then used. ``card`` breaks
    ``device_bytes`` down as NVML counts it (``memfit.trace.card``).
    ``optimizer_only=True`` traces the step's optimizer phase alone (unscale, clip, step, from
    the steady state with every gradient alive; the timeline starts at ``start_breakdown``,
    without the allocator replay): the planner's models of another optimizer implementation or
    state read no more, and the forward and backward cost the most to trace
    (docs/planner.md). A step without such a phase of memfit's own (``step=fn``,
    ``optimizer_in_backward``, ``offload_gradients``, several GPUs) is traced whole.

    ``step``: the user's own training step ``fn(model, batch, optimizer)`` as written
    (zero_grad wherever it is, clipping, a GradScaler, extra forwards, an EMA copy, a second
    loss), traced instead of memfit's (``api._user_step``). It is called on FAKE
    copies of the model, the batch (as given) and the optimizer (built as above), several
    times per estimate (twice: the second call is the steady state that is counted); what it
    keeps between calls must be made from those arguments (e.g. a ``weakref.WeakKeyDictionary``
    keyed on the model or optimizer). It may return the loss or None. The step fixes its own
    precision, micro-batch, clipping and zero_grad: those knobs are refused; ``checkpoint``,
    ``offload``, ``offload_optimizer`` and ``optimizer_impl`` reach it through the model and
    the optimizer. ``scheduler``: a factory ``optimizer -> LR scheduler``, built on the fake
    optimizer and stepped after each step (as ``memfit.fit``'s runner does).

    ``gpus=N`` with ``sharding="fsdp"`` (``reshard_after_forward``, ``fsdp_offload``,
    ``mp_policy``) or ``"ddp"``: one rank's figures of an N-rank job, ``batch`` being one rank's
    batch, traced with PyTorch's FSDP2 or DDP over a fake process group
    (``memfit.api._rank_layout``; ``memfit.estimate_sharded`` also takes a ``rank`` and DDP's
    ``bucket_cap_mb``).
    """
    check_order("estimate", optimizer=optimizer)
    k = Knobs.from_kwargs(**knobs)
    # the optimizer phase traced alone reads no batch (api._traced.phase_alone): one entry
    # serves every batch of the model (a --batch-size auto search plans at many)
    alone = optimizer_only and phase_alone(k, step)
    key = trace_cache.key_for(model, None if alone else batch, optimizer, device, dict(
        knobs=k, budget=budget, allocator=allocator, allocator_replay=allocator_replay,
        cuda_version=cuda_version, compose_blocks=compose_blocks, loss_fn=loss_fn,
        count_fn=count_fn, step=step, scheduler=scheduler, optimizer_only=optimizer_only))
    kept = trace_cache.lookup(key)
    if kept is not None:
        kept.traced_as += "; read from memfit's cache"
        return kept
    est = _traced(model, batch, optimizer, device, loss_fn, k, budget=budget, count_fn=count_fn,
                  allocator=allocator, allocator_replay=allocator_replay, step=step,
                  scheduler=scheduler, cuda_version=cuda_version, compose_blocks=compose_blocks,
                  optimizer_only=optimizer_only)
    trace_cache.store(key, est)
    return est


def _traced(model, batch, optimizer, device, loss_fn, k: Knobs, *, budget, count_fn,
            allocator, allocator_replay, step, scheduler, cuda_version,
            compose_blocks, optimizer_only) -> Estimate:
    """``estimate``'s trace: composed from twins where it can be (``api._blockwise``), else
    whole."""
    why = None
    if compose_blocks:
        try:
            composed, why = blockwise_estimate(model, batch, optimizer, device, loss_fn, k,
                                             budget=budget, count_fn=count_fn,
                                             allocator=allocator,
                                             allocator_replay=allocator_replay, step=step,
                                             scheduler=scheduler, cuda_version=cuda_version,
                                             optimizer_only=optimizer_only)
        except Exception:       # the whole trace says what is wrong, as it always has
            composed = None
        if composed is not None:
            return figures(composed)
    est = traced_estimate(model, batch, optimizer, device, loss_fn, k, FakeCopier("cpu"),
                          budget=budget, count_fn=count_fn, allocator=allocator,
                          allocator_replay=allocator_replay, step=step, scheduler=scheduler,
                          cuda_version=cuda_version, optimizer_only=optimizer_only)[0]
    if why is not None and not why.endswith(TOO_FEW):
        est.traced_as = f"whole: {why}"
    return est


def traced_estimate(model, batch, optimizer, device, loss_fn, k: Knobs, copier: FakeCopier, *,
                    budget=None, count_fn=None, allocator=None, allocator_replay=True, step=None,
                    scheduler=None, cuda_version=None, layout: RankLayout | None = None,
                    optimizer_only: bool = False):
    """``estimate`` traced on fakes made by ``copier``: (the Estimate, the tracker that counted
    it, the CudaModel of a GPU target or None). A shared trace (``memfit.api._shared_shapes``)
    replays the tracker in other shapes. With a data-parallel ``layout``, one rank of it
    (``api._traced.trace_step``)."""
    t = trace_step(model, batch, optimizer, device, loss_fn, k, copier, budget=budget,
                   count_fn=count_fn, allocator=allocator, allocator_replay=allocator_replay,
                   step=step, scheduler=scheduler, cuda_version=cuda_version, layout=layout,
                   optimizer_only=optimizer_only)
    return figures(t), t.tracker, t.cuda
