"""What ``memfit.plan`` says about a plan: the reasons for its global choices, the host memory
its offload needs, and ``BudgetTooSmall`` with the levers beyond memfit's knobs.

Note 1 (the ratio's words). The step-time ratio is against the user's own step (plan Note 3).
A plan that keeps the user's precision and optimizer mostly adds work (a slowdown); one that
changes the precision (or the optimizer implementation) says so, and a ratio below 1 is then
a speed-up.

Note 2 (host memory). A plan that offloads activations or the optimizer state needs host RAM
for them: the re-trace's host peak (memfit's host pool and the host optimizer's state). A plan
that offloads nothing needs none, whatever the trace counted on the host (a CUDA Adam keeps its
0-d ``step`` counters there: a few bytes per parameter, no offload).
"""

from __future__ import annotations

from memfit.errors import BudgetTooSmall
from memfit.optimizers import IMPL_FLAGS
from memfit.planner._explain import ratio_words
from memfit.units import GiB, format_bytes

__all__ = ["global_reasons", "host_bytes", "too_small"]


def host_bytes(choice, est) -> int:
    """Host RAM the plan's offload needs (Note 2)."""
    k = est.knobs
    offloads = choice.offload_optimizer or "offload" in choice.modes or \
        k.offload not in (None, "none")
    return int(est.host_peak_bytes) if offloads else 0


def global_reasons(k, choice, memory, b: int, ctx, ratio: float) -> list[str]:
    out = []
    changed = choice.precision != ctx.user
    if changed:
        fits = "fits" if ctx.plain_bytes <= ctx.budget_bytes else "does not fit"
        out.append(f"precision {choice.precision}, not your {ctx.user}: auto takes the GPU's "
                   f"16-bit autocast (as fast or faster matmuls, half the activation bytes); "
                   f"your plain {ctx.user} step needs {format_bytes(ctx.plain_bytes)} and "
                   f"{fits}. Predicted {ratio_words(ratio)}")
    elif k.precision == "auto":
        out.append(f"precision {choice.precision}: auto keeps fp32 on a CPU")
    if choice.micro_batch_size < b:
        n = -(-b // choice.micro_batch_size)
        out.append(f"micro-batch {choice.micro_batch_size} x {n} accumulated: the largest "
                   "micro-batch the fastest plan could afford (each extra micro-batch repeats "
                   "the launches and weight reads)")
    modes = [m for m in choice.modes if m != "keep"]
    if modes:
        counts = ", ".join(f"{modes.count(m)} {m}" for m in ("recompute", "selective", "offload")
                           if m in modes)
        out.append(f"blocks: {counts} of {len(choice.modes)}: the mix of modes that costs the "
                   "least predicted time (exact MILP over every block) while every peak point "
                   "stays under the cap; the table shows what each saves and pays")
    out += _optimizer_reasons(k, choice, memory, ctx)
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


def too_small(floor_bytes: int, memory, described: str, budget_bytes: int) -> BudgetTooSmall:
    """The floor (re-traced, plan Note 5) and the levers beyond memfit's knobs."""
    params, grads = memory.params_bytes, memory.grads_bytes
    state = memory.optimizer_state_bytes
    levers = []
    train = grads + state
    if train > 0:
        total = params + train
        lead = (f"parameters, gradients and optimizer state alone need {format_bytes(total)}, "
                f"more than the budget: " if total > budget_bytes else "")
        levers.append(
            f"{lead}freeze parameters (requires_grad=False) or train LoRA adapters (peft): the "
            f"weights alone need {format_bytes(params)}; a frozen parameter has no gradient and "
            f"no optimizer state, which here take {format_bytes(train)} "
            f"({format_bytes(grads)} + {format_bytes(state)})")
    if params > budget_bytes:
        levers.append(f"the weights alone ({format_bytes(params)}) exceed the budget: a smaller "
                      "model, 16-bit weights (precision='bf16-pure' halves them) or sharding")
    levers += ["an 8-bit optimizer (e.g. bitsandbytes AdamW8bit) to shrink optimizer state ~4x",
               "shorter sequences (memfit.largest_fitting(..., lever='seq_len') finds the "
               "longest that fits)"]
    share = budget_bytes - (floor_bytes - train)
    ranks = -(-int(train) // int(share)) if share > 0 else None
    if ranks and ranks > 1:
        levers.append(f"sharding (FSDP) over about {ranks} GPUs")
    return BudgetTooSmall(
        f"nothing memfit can do fits {format_bytes(budget_bytes)}: the least device memory "
        f"any plan needs is {format_bytes(floor_bytes)} ({floor_bytes / GiB:.4g} GiB, "
        f"{floor_bytes} B: {described}). Levers beyond this step's knobs: {'; '.join(levers)}",
        floor_bytes=floor_bytes, budget_bytes=budget_bytes)
