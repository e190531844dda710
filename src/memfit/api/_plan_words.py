"""What ``memfit.plan`` says about a plan: the reasons for its global choices, the host memory
its offload needs, and ``BudgetTooSmall`` with the levers beyond memfit's knobs.

Note 1 (the ratio's words). The step-time ratio is against the user's own step (the plain step at
their precision, traced beside the candidates). A plan that keeps the user's precision and optimizer
mostly adds work (a slowdown); one that changes the precision (or the optimizer implementation) says
so, and a ratio below 1 is then a speed-up.

Note 2 (host memory). A plan that offloads activations or the optimizer state needs host RAM
for them: the re-trace's host peak (memfit's host pool and the host optimizer's state). A plan
that offloads nothing needs none, whatever the trace counted on the host (a CUDA Adam keeps its
0-d ``step`` counters there: a few bytes per parameter, no offload).

Note 3 (what is beyond memfit). The floor counts every lever memfit has that the caller's
settings leave free: precision (under "auto"), micro-batches, per-block recompute / selective /
offload, the optimizer state on the host, low-bit optimizer states (when numerics may change),
the loss in pieces (a causal LM's), the optimizer in backward and the block weights on the
host. ``BudgetTooSmall``
then names only what is truly beyond them: freezing or LoRA (a different training job), a
smaller model, shorter sequences (with the longest that fits, traced), and sharding over
several GPUs (the plan is for one); and, apart, memfit's own levers the caller's settings kept
out, so that the floor is not mistaken for memfit's least.

Note 4 (lines a person reads). ``BudgetTooSmall``'s text is one line for the verdict (the
floor in one unit, what it was traced at), one for the levers the floor counts, then one line
per lever beyond them: a person scans it, a program reads ``floor_bytes``.
"""

from __future__ import annotations

from memfit.errors import BudgetTooSmall
from memfit.modes import Mode
from memfit.optimizers import IMPL_FLAGS
from memfit.planner._explain import accumulated_words, ratio_words
from memfit.planner.search import NEAR_TIE
from memfit.techniques.low_bit_optimizer import LIBRARY, NUMERICS_NOTE
from memfit.techniques.packed_int4 import PackedInt4Linear
from memfit.techniques.quantized_base import QuantizedBase
from memfit.trace._coded_weights import holds_coded_weights
from memfit.units import MiB, format_bytes

__all__ = ["global_reasons", "host_bytes", "too_small", "excluded_levers", "counted_levers",
           "lever_reasons"]


def host_bytes(choice, est) -> int:
    """Host RAM the plan's offload needs (Note 2)."""
    k = est.knobs
    offloads = choice.offload_optimizer or Mode.OFFLOAD in choice.modes or \
        k.offload not in (None, "none")
    return int(est.host_peak_bytes) if offloads else 0


def global_reasons(k, choice, memory, b: int, ctx, ratio: float) -> list[str]:
    out = []
    changed = choice.precision != ctx.user
    if changed:
        fits = "fits" if ctx.plain_bytes <= ctx.budget_bytes else "does not fit"
        out.append(f"precision {choice.precision}, not your {ctx.user}: "
                   f"{_PRECISION_WORDS[choice.precision].format(gpu=ctx.spec.display_name)}; "
                   f"your plain {ctx.user} step needs {format_bytes(ctx.plain_bytes)} and "
                   f"{fits}. Predicted {ratio_words(ratio)}")
    elif k.precision == "auto" and ctx.spec.kind == "cuda":
        out.append(f"precision {choice.precision}: auto keeps your numerics: fp32 is "
                   "predicted the fastest that fits of the precisions weighed (on a card whose "
                   "16-bit matmuls are no faster, 16-bit buys only memory, and its casts cost "
                   "time)")
    elif k.precision == "auto":
        out.append(f"precision {choice.precision}: auto keeps fp32 on a CPU")
    if choice.micro_batch_size < b:
        why = (f"your micro_batch_size={k.micro_batch_size}" if k.micro_batch_size is not None
               else "the largest micro-batch the fastest plan could afford (each extra "
                    "micro-batch repeats the launches and weight reads)")
        out.append(f"{accumulated_words(b, choice.micro_batch_size)}: {why}")
    modes = [m for m in choice.modes if m != Mode.KEEP]
    if modes:
        counts = ", ".join(f"{modes.count(m)} {m}" for m in
                           (Mode.RECOMPUTE, Mode.SELECTIVE, Mode.OFFLOAD) if m in modes)
        fixed = [f"{name}={_policy_words(v)}" for name, v in
                 (("checkpoint", k.checkpoint), ("offload", k.offload)) if v is not None]
        why = (f"as your {' and '.join(fixed)} set" if fixed and
               all(v is not None for v in (k.checkpoint, k.offload)) else
               _one_mode_words(choice) if choice.mix_step_s is not None else
               "the mix of modes that costs the least predicted time (exact MILP over every "
               "block) while every peak point stays under the cap" +
               (f", within your {' and '.join(fixed)}" if fixed else "") +
               "; the table shows what each saves and pays")
        out.append(f"blocks: {counts} of {len(choice.modes)}: {why}")
    out += _optimizer_reasons(k, choice, memory, ctx)
    out += lever_reasons(k, choice, memory, ctx)
    return out


def _one_mode_words(choice) -> str:
    """Why one mode in every block was answered over the MILP's fastest mix
    (``planner.search._one_mode``)."""
    faster = 1 - choice.mix_step_s / choice.step_s
    return (f"one mode in every block: the fastest mix of modes (exact MILP over every block) "
            f"is predicted only {faster:.2%} faster, less than the time model resolves "
            f"({NEAR_TIE:.0%}); one mode in every block holds no more memory, and it is "
            "verified from two shallow twins of the model rather than by tracing it whole")


def _policy_words(value) -> str:
    """A checkpoint / offload policy as typed: a string as is, block names joined by commas
    (never a Python tuple)."""
    return value if isinstance(value, str) else ",".join(value)


_PRECISION_WORDS = {   # why auto chose it, and which numerics change (docs/planner.md)
    "bf16": "auto takes bf16 autocast, which the {gpu} supports: matmuls and activations in "
            "bf16 (fp32's range: no loss scaling), weights, gradients and optimizer state stay "
            "fp32; the numerics change by bf16's rounding of the autocast ops",
    "fp16": "auto takes fp16 autocast with loss scaling (the {gpu} has no bf16): matmuls and "
            "activations in fp16, weights, gradients and optimizer state stay fp32; the "
            "numerics change by fp16's rounding and range (a GradScaler skips steps that "
            "overflow)",
    "bf16-pure": "auto takes pure bf16 (the {gpu} supports bf16): weights, activations and "
                 "gradients in bf16, fp32 master weights updated by the optimizer; no casts and "
                 "the fewest activation bytes, the largest change to the numerics of the "
                 "precisions weighed (every op rounds to bf16)",
    "fp32": "auto keeps fp32",
}


def lever_reasons(k, choice, memory, ctx) -> list[str]:
    """Why a low-bit optimizer state, the loss in pieces or parameter offload
    (planner.variants), in words."""
    out = []
    state = choice.optimizer_state
    if state is not None and state != k.optimizer_state:
        why = "precision='auto' allows it" if k.precision == "auto" else \
            "allow_numerics_change=True allows it"
        saved = getattr(ctx, "fp32_state_bytes", 0) - memory.optimizer_state_bytes
        lib = LIBRARY[state]
        out.append(f"optimizer state {state} ({lib}): this "
                   f"{NUMERICS_NOTE.format(what=state, lib=lib)}; "
                   f"{why}. It saves {format_bytes(max(saved, 0))} of device memory against "
                   "fp32 state, for a step predicted faster than any plan without it; fit "
                   f"rebuilds the optimizer as {lib}'s low-bit Adam/AdamW")
    chunks = choice.chunked_loss
    if chunks is not None and chunks != k.chunked_loss:
        out.append(f"loss in {chunks} pieces (chunked_loss={chunks}): the head and the "
                   f"cross-entropy run over 1/{chunks} of the tokens at a time and each piece's "
                   "logits are recomputed in backward (one more forward of the head per step), "
                   "so the tokens x vocabulary logits never exist whole; predicted faster than "
                   "any plan that fits with the model's own loss. The numerics do not change "
                   "beyond the order of one sum")
    if choice.optimizer_in_backward and not k.optimizer_in_backward:
        out.append("optimizer in backward (optimizer_in_backward=True): each parameter is "
                   "stepped by its own optimizer as soon as backward has made its gradient, "
                   "which is then freed, so the whole set of gradients never exists (as "
                   "torchtune's optimizer_in_bwd); predicted faster than any plan that fits "
                   "without it. The numerics do not change; there is no accumulation, no "
                   "clipping and no re-plan on out-of-memory with it")
    if choice.offload_gradients and not k.offload_gradients:
        out.append("gradients on the host (offload_gradients=True): no plan that keeps them on "
                   "the device fits; each is copied to the host as backward makes it and freed "
                   "on the device (as torchao's CPUOffloadOptimizer(offload_gradients=True)), "
                   "every micro-batch over the host link, accumulated on the host, where the "
                   "optimizer steps. The numerics do not change")
    if choice.offload_params is not None and choice.offload_params != k.offload_params:
        out.append(f"block weights on the host (offload_params={choice.offload_params!r}): no "
                   "plan that keeps the weights on the device fits; each block's weights are "
                   "fetched before its forward and again before its backward (every "
                   "micro-batch, over the host link), and the optimizer state is on the host "
                   "(the weights' host copies are its own). The numerics do not change")
    return out


def _optimizer_reasons(k, choice, memory, ctx) -> list[str]:
    out = []
    impl = choice.optimizer_impl or ctx.default_impl
    if choice.offload_optimizer:
        out.append("optimizer state on the host: the optimizer step runs on the CPU, which "
                   f"frees {format_bytes(memory.optimizer_state_bytes)} of device memory that no "
                   "recompute or offload of activations could")
        if memory.peak_phase() == "optimizer" and not ctx.impl_searched and \
                impl == "foreach":
            out.append("the plain step peaks in the optimizer step (a foreach optimizer's "
                       "temporaries are parameter-sized): optimizer_impl='fused' (e.g. "
                       "torch.optim.AdamW(fused=True)) or 'for-loop' (foreach=False) would "
                       "lower that peak without moving the state to the host; plan again with "
                       "it")
    elif choice.optimizer_impl != k.optimizer_impl:
        flags = ", ".join(f"{f}={v}" for f, v in IMPL_FLAGS[choice.optimizer_impl].items())
        out.append(f"optimizer {choice.optimizer_impl} (memfit's choice; the optimizer as given "
                   f"runs {ctx.default_impl}): its step needs fewer temporaries, the cheapest "
                   f"lever before moving the optimizer state to the host; fit rebuilds the "
                   f"optimizer with {flags}")
    if not choice.offload_optimizer and impl is not None:
        source = "as you set it" if k.optimizer_impl is not None else \
            "memfit's choice" if choice.optimizer_impl is not None else \
            "the optimizer as given" + (" (CUDA's default)" if impl == "foreach" else "")
        out.append(f"optimizer step modelled as {impl} ({source})")
    return out


def too_small(floor_bytes: int, memory, described: str, budget_bytes: int,
              excluded: list[str] = (), seq: tuple[int | None, int] | None = None,
              gpus: int = 1, counted: list[str] = (), bound: bool = False,
              layout=None, model=None, bare: bool = False,
              context_bytes: int = 0) -> BudgetTooSmall:
    """The floor (re-traced over every lever memfit has) and what is beyond it
    (Note 3): ``excluded``, memfit's levers the caller's settings left out; ``seq``, (the
    longest sequence the floor's configuration fits, or None if none does; the batch's).
    ``bound``: ``floor_bytes`` is the floor's lower bound from the parameters alone (what every
    configuration holds), found before any trace: the floor is at least that. ``layout``: the
    fewest GPUs the layout search finds (``api._compare_gpus.fewest_gpus``'s row), for the
    sharding line. ``model``: for the QLoRA line. ``context_bytes``: the CUDA context, outside
    every lever (a budget at or below it says so instead of the levers). One line per lever
    (Note 4)."""
    params, grads = memory.params_bytes, memory.grads_bytes
    state = memory.optimizer_state_bytes
    levers = []
    train = grads + state
    if train > 0:
        total = params + train
        lead = (f"parameters, gradients and optimizer state alone need {format_bytes(total)}, "
                f"more than the budget: " if total > budget_bytes else "")
        levers.append(
            f"{lead}a lower LoRA rank or fewer target modules: the adapters' gradients and "
            f"optimizer state take {format_bytes(train)} ({format_bytes(grads)} + "
            f"{format_bytes(state)}), the weights {format_bytes(params)}"
            if getattr(model, "peft_config", None) else      # LoRA already: fewer adapters
            f"{lead}freeze parameters (requires_grad=False) or train LoRA adapters (peft): the "
            f"weights alone need {format_bytes(params)}; a frozen parameter has no gradient and "
            f"no optimizer state, which here take {format_bytes(train)} "
            f"({format_bytes(grads)} + {format_bytes(state)})")
    if model is not None and (line := _qlora_line(model)):
        levers.append(line)
    if params > budget_bytes:
        levers.append(f"the weights alone ({format_bytes(params)}) exceed the budget: a smaller "
                      "model")
    if seq is not None:
        longest, given = seq
        levers.append(f"shorter sequences: the longest this budget holds under the least-memory "
                      f"configuration is {longest} tokens (the batch has {given})"
                      if longest else
                      f"shorter sequences would not do: even the shortest input (of the batch's "
                      f"{given} tokens) does not fit the least-memory configuration")
    if gpus == 1:
        levers.append("sharding (FSDP) over several GPUs: this plan is for one"
                      + ("" if layout is None else
                         f"; the layout search (plan --gpus auto) finds that {layout.layout} "
                         f"fits, {format_bytes(layout.rank_bytes)} per GPU (modelled)"
                         if layout.gpus else
                         f"; the layout search (plan --gpus auto) finds no layout that fits "
                         f"either ({layout.why})"))
    needs = "needs at least" if bound else "needs"
    lines = [f"nothing memfit can do fits {format_bytes(budget_bytes)}: the least device memory "
             f"any plan {needs} {format_bytes(floor_bytes)} ({described})."]
    if 0 < context_bytes and budget_bytes <= context_bytes:     # no lever of the step can help
        return BudgetTooSmall(
            "\n".join(lines + [
                f"The CUDA context alone (the runtime and kernels on the card before any tensor, "
                f"{format_bytes(context_bytes)}) is at least the budget, so no change to the "
                f"model or the step fits it: give a budget above {format_bytes(context_bytes)} "
                "(the card's usable memory counts the context)"]),
            floor_bytes=floor_bytes, budget_bytes=budget_bytes, floor_is_bound=bound)
    if bare and 0 < budget_bytes < MiB:   # an int under a MiB: a unit left out, likely
        lines.append(f"The budget is {budget_bytes} bytes (an integer budget counts bytes): for "
                     f"{budget_bytes} GiB write budget='{budget_bytes}GiB'.")
    if counted:
        lines.append(f"The floor counts {', '.join(counted)}.")
    lines.append("Beyond memfit's levers:")
    lines += [f"  - {lever}" for lever in levers]
    if excluded:
        lines.append("memfit's levers your settings left out (the floor does not count them):")
        lines += [f"  - {lever}" for lever in excluded]
    return BudgetTooSmall("\n".join(lines), floor_bytes=floor_bytes, budget_bytes=budget_bytes,
                          floor_is_bound=bound)


def _qlora_line(model) -> str | None:
    """QLoRA in numbers: the float linear weights and what bitsandbytes' NF4 layout holds them
    in (``techniques.quantized_base``), where they are float."""
    if holds_coded_weights(model) or \
            any(isinstance(m, PackedInt4Linear) for m in model.modules()):
        return None        # a base held in fewer bits already (bitsandbytes' codes, GPTQ's)
    tech = QuantizedBase(QuantizedBase.Config("nf4"))
    weights = [layer.weight for _, _, layer in tech.layers(model)
               if layer.weight.is_floating_point()]
    frozen = [w for w in weights if not w.requires_grad]    # a LoRA job: its base, not adapters
    weights = frozen or weights
    if not weights:
        return None
    now = sum(w.numel() * w.element_size() for w in weights)
    nf4 = sum(tech.layout_bytes(*w.shape) for w in weights)
    return (f"QLoRA (memfit.techniques.QuantizedBase, then peft's LoRA): the "
            f"{len(weights)} linear layers' weights take {format_bytes(now)}; held in NF4 with "
            f"double quantization (bitsandbytes' layout) they take {format_bytes(nf4)}, frozen, "
            "with no gradient or optimizer state (LoRA trains small adapters beside them); it "
            "changes the numerics")


def counted_levers(k, numerics: bool, user_step: bool, precisions,
                   chunked: bool = False, in_backward: bool = False) -> list[str]:
    """The levers the floor weighed (Note 3), in words; ``chunked``: the loss in pieces was
    modelled; ``in_backward``: the optimizer in backward was."""
    out = [f"precision {'/'.join(precisions)}"]
    if not user_step and k.micro_batch_size is None:
        out.append("micro-batches")
    out.append("per-block recompute and activation offload")
    if k.offload_optimizer is not False:
        out.append("the optimizer state on the host")
    if numerics and k.optimizer_state is None and not user_step:
        out.append("a bf16, 4-bit (torchao) or 8-bit (bitsandbytes) optimizer state")
    if chunked:
        out.append("the loss in pieces (chunked_loss)")
    if in_backward:
        out.append("the optimizer in backward (optimizer_in_backward)")
    if k.offload_gradients is None and k.offload_optimizer is not False and not user_step \
            and k.offload_params in (None, "none") and not k.optimizer_in_backward and \
            k.precision != "fp16":
        out.append("the gradients on the host (offload_gradients)")
    if k.offload_params is None and k.offload_optimizer is not False and not user_step:
        out.append("the block weights on the host")
    return out


def excluded_levers(k, numerics: bool, user_step: bool) -> list[str]:
    """memfit's levers the caller's settings keep out of the search (Note 3)."""
    out = []
    if not numerics and k.optimizer_state is None and not user_step:
        out.append("a 4-bit or 8-bit optimizer state (8-bit: about a quarter of fp32 Adam's; "
                   "allow_numerics_change=True or precision='auto' lets the planner weigh it)")
    if k.precision not in (None, "auto") or (k.precision is None and not user_step):
        out.append("16-bit precision (bf16 / fp16 autocast, bf16-pure weights): "
                   "precision='auto' lets the planner weigh it")
    if k.chunked_loss == 0:
        out.append("the loss in pieces (chunked_loss=0), which keeps a causal LM's tokens x "
                   "vocabulary logits from existing whole")
    if k.optimizer_in_backward is False:
        out.append("the optimizer in backward (optimizer_in_backward=False), which frees each "
                   "gradient as soon as it is stepped")
    if k.offload_optimizer is False:
        out.append("the optimizer state on the host (offload_optimizer=False)")
    if k.offload_gradients is False or (k.offload_gradients is None and
                                        k.offload_optimizer is False):
        out.append("the gradients on the host as backward makes them (offload_gradients; it "
                   "needs offload_optimizer)")
    if k.offload_params == "none" or (k.offload_params is None and k.offload_optimizer is False):
        out.append("the block weights on the host (offload_params; it needs "
                   "offload_optimizer)")
    return out
