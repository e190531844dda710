"""The planner's levers beyond per-block modes: one memory and time model per low-bit optimizer
state and per parameter offload, from a trace of each (the search takes each as a longer model
key, ``search.variant_key``).

Note 1 (what is traced). The caller (``api._plan_levers``, for ``api._planner``) passes
``trace(precision, samples, **knobs)`` (an ``estimate`` without the allocator replay;
``samples`` ``None`` for the whole batch, else the first ``samples`` of it) so that this layer
imports nothing above it.
- A low-bit state ``s`` costs one trace of the optimizer phase alone (the first precision's
  step with ``optimizer_state=s``, ``estimate(optimizer_only=True)``: unscale, clip and the
  step, from the steady state with every gradient alive), shared by every precision: the
  memory and time models read the state's bytes and its step off it
  (``with_optimizer_state``, ``with_optimizer_step``; the state does not depend on the autocast
  precision, and it is made before the step, so every point of forward and backward shifts by
  its bytes alone); the forward and backward points stay the fp32-state model's.
- Parameter offload ("all" blocks, with the optimizer state on the host: it needs it) costs two
  traces (the whole batch and half of it: every point a line in the micro-batch), at the
  precision "auto" prefers (the one traced first): fetched weights change every point of the
  step. Its model allows the optimizer state on the host only and no activation offload
  (``placements``, ``excluded_modes``), and its time model pays the host link for every
  offloaded weight twice per micro-batch (``with_fetches``: the copies are synchronous).

- The loss in pieces (``chunked_loss=CHUNKED_LOSS``, a causal LM's cross-entropy over pieces
  of the tokens, each piece's logits recomputed in backward) costs two traces (the whole batch
  and half of it), at the precision "auto" prefers with the optimizer as given: it changes
  the points of the step where the logits live (the loss, the start of backward) and adds a
  second forward of the head, both read off the trace; the model allows what the plain
  model allows (``placements``, ``excluded_modes``, the card's ratio and context). Beside
  each model of that precision with another optimizer implementation or a low-bit state, the
  same optimizer with the loss in pieces is a model too, without a trace: the chunked step's
  forward and backward, that model's optimizer (its state's bytes beyond the plain one's, its
  step's rise and time: ``with_optimizer_of``); the optimizer does not see how the loss was
  taken.
- The optimizer stepped in backward (``optimizer_in_backward``: one optimizer per parameter,
  run by its gradient hook, which frees the gradient) costs one trace of the whole batch, at the
  first precision it runs with (fp32 or bf16: fp16's GradScaler and bf16-pure's masters need
  every gradient after backward), with the optimizer as given: every point of backward changes
  (gradients freed as they come, each step's temporaries inside backward). Its model holds for
  the whole batch only (``whole_batch``: no accumulation) with the state on the device
  (``placements``), and keeps the plain model's block modes, card ratio and context.
- The gradients moved to the host as backward makes them (``offload_gradients``, with the
  optimizer state there: it needs it) cost two traces (the whole batch and half of it), at the
  precision "auto" prefers where it runs (fp32 or bf16: fp16's GradScaler reads the device
  gradients, bf16-pure keeps no state on the host), with the optimizer as given: every point of
  backward and the step changes (no gradient lives on past its hook). Its model allows the
  state on the host only (``placements``), keeps the plain model's block modes, card ratio and
  context, and accumulates micro-batches on the host (``grads_on_host``: each one is the
  first on the device); its time model pays the link for the plain model's gradient bytes in
  every micro-batch (``with_gradient_offload``).

Note 2 (when). Low-bit states change the numerics: they are weighed only when the caller
allows it (``allow_numerics_change``, implied by ``precision="auto"``), only for Adam/AdamW
(bitsandbytes' 8-bit, torchao's 4-bit and bf16), and a state whose library is missing or
that the optimizer refuses is skipped. Parameter offload is a
last resort (synchronous copies of every weight, twice per micro-batch): it is weighed when
nothing else fits, and by the floor. The gradients on the host come before it, on the same
terms (when nothing else fits, and by the floor): their copies, every gradient once per
micro-batch, cost less than the weights' twice, and a plan that fits without them is never
traced with them. The chunked loss keeps the numerics (the same sum in
another order) and is weighed with the low-bit states, once the plain step does not fit, where
the step's loss is the model's own (no ``loss_fn``, no ``step=fn``) and the model is a causal
LM the technique takes (``techniques.chunked_loss``); the search weighs its recompute against
every other lever's cost by the time model. The optimizer in backward keeps the numerics (the
same per-parameter update) and is weighed with them, once the plain step does not fit, where
nothing the caller fixed needs every gradient after backward (accumulation, clipping, the
state on the host, a ``step=fn``); whether it lowers the peak is the trace's answer (it does
where the optimizer step or the end of backward peaks; where the activations peak early in
backward, the steps' temporaries can raise it).

Note 3 (precisions under "auto"). On a GPU: the 16-bit autocast the card has (bf16 where it supports
it: fp32's range, no loss scaling; else fp16 with a GradScaler), bf16-pure where bf16 is supported
(bf16 weights, activations and gradients, fp32 master weights for the optimizer: no casts, the least
activation bytes, the most change to the numerics), and fp32 itself, the user's numerics: it wins
where the card's 16-bit matmuls are no faster than its fp32 ones (no tensor cores, as on Pascal,
whose 16-bit matmuls run at the fp32 rate; it is then listed second, after the 16-bit the card has),
so that 16-bit buys only memory and its casts cost time, and where a small step is bound by
launches, not matmuls. On a CPU: fp32.
"""

from __future__ import annotations

from collections.abc import Callable

from memfit.modes import Mode
from memfit.planner.memory_model import MemoryModel
from memfit.planner.choice import variant_key
from memfit.planner.time_model import TimeModel, flop_rate

__all__ = ["LOW_BIT_STATES", "PARAM_OFFLOAD", "CHUNKED_LOSS", "IN_BACKWARD_PRECISIONS",
           "GRAD_OFFLOAD_PRECISIONS", "low_bit_keys", "add_low_bit", "add_param_offload",
           "add_chunked_loss",
           "chunked_beside", "add_optimizer_in_backward", "add_gradient_offload",
           "auto_precisions"]

LOW_BIT_STATES = ("bf16", "8bit", "4bit")
PARAM_OFFLOAD = "all"
CHUNKED_LOSS = 8          # pieces of the tokens (torchtune's num_output_chunks default)
IN_BACKWARD_PRECISIONS = ("fp32", "bf16")     # those the optimizer in backward runs with
GRAD_OFFLOAD_PRECISIONS = ("fp32", "bf16")     # those offload_gradients runs with (Note 1)


def low_bit_keys(models: dict) -> list[tuple]:
    """The plain models a low-bit state is modelled beside: every ``(precision, None)`` whose
    precision keeps its optimizer over the parameters (bf16-pure's steps fp32 masters)."""
    return [k for k in models if len(k) == 2 and k[1] is None and k[0] != "bf16-pure"]


def add_low_bit(models: dict, traces: dict, trace: Callable, say: Callable[[str], None],
                states=LOW_BIT_STATES, keys: list[tuple] | None = None) -> list[str]:
    """Add a model per low-bit state beside each of ``keys`` (default ``low_bit_keys``, Note
    1); ``traces``: precision -> its plain trace. Returns the states added (those the
    libraries and the optimizer accept)."""
    added = []
    keys = low_bit_keys(models) if keys is None else keys
    for state in states:
        est = None
        for key in keys:                       # bf16-pure's optimizer steps fp32 masters
            precision = key[0]
            if est is None:                    # one trace per state, shared (Note 1)
                say(f"tracing the optimizer step with {state} optimizer state ({precision})")
                try:
                    est = trace(precision, None, optimizer_state=state, optimizer_only=True)
                except (ValueError, ImportError):  # library missing, a class it lacks
                    break
            memory, time = models[key]
            models[variant_key(precision, None, state)] = (
                memory.with_optimizer_state(est), time.with_optimizer_step(est))
            if state not in added:
                added.append(state)
    return added


def add_param_offload(models: dict, traces: dict, trace: Callable, spec, b: int,
                      say: Callable[[str], None], precisions=None) -> bool:
    """Add a parameter-offload model per precision (of ``precisions``, default all) that may
    offload its optimizer (Note 1). Returns whether any was added."""
    added = False
    for key in [k for k in models if len(k) == 2 and k[1] is None and
                (precisions is None or k[0] in precisions)]:
        precision = key[0]
        memory = models[key][0]
        if True not in memory.placements or not memory.blocks:
            continue
        say(f"tracing the plain step with the block weights on the host ({precision})")
        traced = _two_point_models(trace, spec, precision, b, memory, placements=(True,),
                                   excluded_modes=(Mode.OFFLOAD,),
                                   offload_params=PARAM_OFFLOAD, offload_optimizer=True)
        if traced is None:
            continue
        pmem, ptime = traced
        pmem.optimizer_state_bytes = memory.optimizer_state_bytes   # the host's, as given
        base = traces[precision]
        fetched = 2 * sum(base.modules[n].param_bytes for n in base.blocks if n in base.modules)
        models[variant_key(precision, None, None, PARAM_OFFLOAD)] = (
            pmem, ptime.with_fetches(fetched))
        added = True
    return added


def add_chunked_loss(models: dict, trace: Callable, spec, b: int, say: Callable[[str], None],
                     key: tuple, chunks: int = CHUNKED_LOSS) -> bool:
    """Add a model of the loss in ``chunks`` pieces beside the plain model at ``key``
    (``(precision, impl)``, Note 1). Returns whether it was added (False: the model or its
    loss is not one the technique takes)."""
    precision, impl = key
    memory = models[key][0]
    say(f"tracing the plain step with the loss in {chunks} pieces ({precision})")
    traced = _two_point_models(trace, spec, precision, b, memory,
                               placements=memory.placements,
                               excluded_modes=memory.excluded_modes,
                               chunked_loss=chunks, optimizer_impl=impl)
    if traced is None:
        return False
    models[variant_key(precision, impl, None, None, chunks)] = traced
    for other in [q for q in models if q[0] == precision and len(q) <= 4 and q != key and
                  (len(q) == 2 or q[3] is None)]:       # other optimizers, not param offload
        chunked_beside(models, key, other, chunks)
    return True


def chunked_beside(models: dict, key: tuple, other: tuple, chunks: int = CHUNKED_LOSS) -> None:
    """Where the loss in pieces is modelled beside the plain model at ``key``: the same with
    the optimizer of ``other`` (another implementation or a low-bit state of that precision,
    Note 1), without a trace."""
    precision, impl = key
    chunked = models.get(variant_key(precision, impl, None, None, chunks))
    if chunked is None:
        return
    (cmem, ctime), (vmem, vtime) = chunked, models[other]
    state = other[2] if len(other) > 2 else None
    models[variant_key(precision, other[1], state, None, chunks)] = (
        cmem.with_optimizer_of(models[key][0], vmem), ctime.with_optimizer_of(vtime))


def add_optimizer_in_backward(models: dict, trace: Callable, spec, b: int,
                              say: Callable[[str], None], key: tuple) -> bool:
    """Add a model of the optimizer stepped in backward beside the plain model at ``key``
    (``(precision, impl)``, Note 1). Returns whether it was added (False: the step refuses it)."""
    precision, impl = key
    memory = models[key][0]
    if False not in memory.placements:
        return False
    say(f"tracing the plain step with the optimizer in backward ({precision})")
    try:
        est = trace(precision, None, optimizer_in_backward=True, optimizer_impl=impl)
    except ValueError:
        return False
    fmem = MemoryModel(est, b).limited(placements=(False,), excluded_modes=memory.excluded_modes,
                                       whole_batch=True)
    fmem.device_ratio, fmem.context_bytes = memory.device_ratio, memory.context_bytes
    models[variant_key(precision, impl, in_backward=True)] = (
        fmem, TimeModel(est, spec, precision, b, fmem))
    return True


def add_gradient_offload(models: dict, trace: Callable, spec, b: int,
                         say: Callable[[str], None], key: tuple) -> bool:
    """Add a model of the gradients moved to the host in backward beside the plain model at
    ``key`` (``(precision, impl)``, Note 1). Returns whether it was added (False: the model
    keeps its state on the device only, or the step refuses it)."""
    precision, impl = key
    memory = models[key][0]
    if True not in memory.placements or precision not in GRAD_OFFLOAD_PRECISIONS:
        return False
    say(f"tracing the plain step with the gradients moved to the host in backward ({precision})")
    traced = _two_point_models(trace, spec, precision, b, memory, placements=(True,),
                               excluded_modes=memory.excluded_modes, offload_optimizer=True,
                               offload_gradients=True, optimizer_impl=impl)
    if traced is None:
        return False
    gmem, gtime = traced
    gmem.grads_on_host = True
    gmem.optimizer_state_bytes = memory.optimizer_state_bytes   # the host's, as given
    models[variant_key(precision, impl, grads=True)] = (
        gmem, gtime.with_gradient_offload(memory.grads_bytes))
    return True


def _two_point_models(trace: Callable, spec, precision: str, b: int, plain: MemoryModel, *,
                      placements, excluded_modes, **knobs):
    """(memory, time) models of the step with ``knobs``, from two traces (the whole batch and
    half of it, Note 1), holding the plain model's card ratio and context; None where the step
    cannot be traced with them (a ``ValueError``)."""
    try:
        est = trace(precision, None, **knobs)
        half = trace(precision, b // 2, **knobs) if b > 1 else None
    except ValueError:
        return None
    memory = MemoryModel(est, b, half).limited(placements=placements,
                                               excluded_modes=excluded_modes)
    memory.device_ratio, memory.context_bytes = plain.device_ratio, plain.context_bytes
    return memory, TimeModel(est, spec, precision, b, memory, half)


def auto_precisions(spec) -> list[str]:
    """The precisions "auto" weighs on ``spec`` (Note 3), the first the one it prefers."""
    if spec.kind != "cuda":
        return ["fp32"]
    half = "bf16" if spec.supports_bf16 else "fp16"
    out = [half, "fp32"] if flop_rate(spec, half) <= spec.peak_fp32_flops else [half]
    if spec.supports_bf16:
        out.append("bf16-pure")
    if "fp32" not in out:
        out.append("fp32")
    return out
