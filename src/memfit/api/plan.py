"""``memfit.plan``: the fastest configuration predicted to fit a budget, verified by a re-trace.

Note 1 (the pipeline). Trace the plain step once per candidate precision (the whole effective
batch as one micro-batch). If one fits, nothing needs to change: take the fastest that fits.
Else build the memory and time models from those traces (planner.memory_model,
planner.time_model), search (planner.search), and re-trace the step with the choice applied.

Note 2 (verification). The re-trace is the answer: its peak and reserved bytes are the plan's
predictions. If it does not fit, the search runs again with the cap lowered by what was
missing (per precision, accumulated), up to ``_ATTEMPTS`` times; the model's errors cost speed,
never the budget. On CPU the re-trace is exact (track counts the same bytes); on a GPU it is the
CUDA model of ``estimate``.

Note 3 (precision "auto"). On a GPU, auto searches the 16-bit precision the card has (bf16, else
fp16 autocast): its matmuls run at least as fast as fp32 (time_model Note 2) and its activations
take half the bytes. The step-time ratio is against the plain step at the user's precision
(fp32 under auto), timed from the 16-bit traces (time_model Note 5). On the CPU auto is fp32.

Note 4 (the caller's batch). The trace runs the batch as the step uses it: an all-ones
attention mask dropped, bf16-pure's float inputs cast. ``runner.step(batch)`` keeps the
caller's batch alive beside it, so those unused bytes are added to every prediction and check.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from memfit.api._setup import resolve_device, resolve_precision
from memfit.api._validate import check_batch
from memfit.api.estimate import Estimate, estimate
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.measure import storages_of
from memfit.planner import Plan
from memfit.planner.memory_model import MemoryModel
from memfit.planner.search import Choice, Constraints, floor, search
from memfit.planner.time_model import TimeModel
from memfit.step import prepare_batch
from memfit.techniques._blocks import resolve_policy
from memfit.techniques.accumulation import Accumulation, batch_size_of
from memfit.techniques.precision import Precision
from memfit.units import GiB, format_bytes, parse_bytes

__all__ = ["plan", "plan_traced", "Planned"]

_ATTEMPTS = 5
_SLACK_BYTES = 2 ** 20       # added to each verified shortfall, so a retry does not land on it


def plan(model: nn.Module, batch, budget=None, optimizer="adamw", device=None,
         loss_fn: Callable | None = None, **kwargs) -> Plan:
    """The fastest configuration of the step predicted to fit ``budget`` device bytes.

    ``budget``: bytes or "11GiB" (default: the device's usable memory). Knobs the caller sets
    are kept; the rest are searched: ``precision`` only under "auto", ``micro_batch_size``,
    per-block keep / recompute / selective / offload, ``offload_optimizer``. Other arguments as
    in ``memfit.estimate``; ``on_progress(message)`` hears each stage. Raises
    ``memfit.BudgetTooSmall`` (with the floor) when nothing in the search space fits.
    """
    return plan_traced(model, batch, budget, optimizer, device, loss_fn, **kwargs).plan


@dataclass
class Planned:
    """A plan with the traces behind it: the plain step (at the plan's precision, the whole
    batch in one micro-batch) and the step with the plan applied (its re-trace)."""

    plan: Plan
    plain: Estimate
    chosen: Estimate


def plan_traced(model: nn.Module, batch, budget=None, optimizer="adamw", device=None,
                loss_fn: Callable | None = None, *, count_fn: Callable | None = None,
                allocator=None, on_progress: Callable[[str], None] | None = None,
                **knobs) -> Planned:
    """``plan``, with the plain and the chosen traces (for plots and reports)."""
    say = on_progress or (lambda message: None)
    k = Knobs.from_kwargs(**knobs)
    k.check_available()
    if k.remat:
        raise ValueError("remat=True: DTR keeps the budget at run time and the planner does not "
                         "weigh it against static plans yet; plan without remat, or use "
                         "memfit.fit(..., budget=..., remat=True) (or memfit.estimate(..., "
                         "remat=True, budget=...) to simulate it)")
    spec = resolve_device(model, device)
    budget_bytes = parse_bytes(budget) if budget is not None else spec.usable_bytes
    if budget_bytes > spec.usable_bytes and spec.kind == "cuda":
        warnings.warn(f"budget {format_bytes(budget_bytes)} is more than the "
                      f"{spec.display_name}'s usable {format_bytes(spec.usable_bytes)}: the plan "
                      "is for a card that large", stacklevel=3)
    original, batch = batch, prepare_batch(batch)
    check_batch(model, batch, loss_fn)
    b = batch_size_of(batch)
    precisions = [resolve_precision(k.precision, spec)]     # auto: one candidate (Note 3)
    fixed = _constraints(model, k, b)
    common = dict(optimizer=optimizer, device=spec, loss_fn=loss_fn, count_fn=count_fn,
                  allocator=allocator, max_grad_norm=k.max_grad_norm)
    traces, models = {}, {}
    for p in precisions:
        say(f"tracing the plain step ({p}, batch {b})")
        traces[p] = estimate(model, batch, precision=p, **common)
        models[p] = _models(model, batch, traces[p], common, spec, p, b, say)
    user = "fp32" if k.precision in (None, "auto") else precisions[0]
    baseline_s = _baseline_s(models, user, b)
    best_floor = floor(models, b, fixed)
    held = {p: _held_bytes(original, p) for p in precisions}   # Note 4

    plain = [p for p in precisions if traces[p].device_bytes + held[p] <= budget_bytes]
    if plain and fixed.modes is None and not fixed.offload_optimizer and \
            fixed.micro_batch_size in (None, b):
        p = min(plain, key=lambda q: models[q][1].step_s(b, b, ("keep",) * len(traces[q].blocks),
                                                          False))
        choice = _as_choice(models[p], p, b, traces[p])
        return Planned(_make_plan(k, choice, traces[p], models[p], spec, budget_bytes, baseline_s,
                                  best_floor, b, ["the plain step fits: nothing to change"],
                                  held[p]), traces[p], traces[p])

    margins: dict[str, int] = dict(held)
    for attempt in range(_ATTEMPTS):
        say("searching" if attempt == 0 else f"searching again (attempt {attempt + 1})")
        choice = search(models, b, budget_bytes, fixed, margins)
        if choice is None:
            break
        say(f"verifying: re-tracing {_describe(choice, b)}")
        p = choice.precision
        est = estimate(model, batch, precision=p,
                       **_knob_values(choice, models[p][0].blocks, k), **common)
        if est.device_bytes + held[p] <= budget_bytes:
            reasons = [] if attempt == 0 else [
                f"the first {attempt} choice(s) re-traced over the budget; the search ran again "
                f"{format_bytes(margins[p] - held[p])} tighter"]
            return Planned(_make_plan(k, choice, est, models[p], spec, budget_bytes, baseline_s,
                                      best_floor, b, reasons, held[p]), traces[p], est)
        short = est.device_bytes + held[p] - budget_bytes + _SLACK_BYTES
        margins[choice.precision] = margins.get(choice.precision, 0) + short
    say("re-tracing the least-memory configuration")
    p = best_floor.precision
    est = estimate(model, batch, precision=p,
                   **_knob_values(best_floor, models[p][0].blocks, k), **common)
    if est.device_bytes + held[p] <= budget_bytes:
        return Planned(_make_plan(k, best_floor, est, models[p], spec, budget_bytes, baseline_s,
                                  best_floor, b, ["only the least-memory configuration fits"],
                                  held[p]), traces[p], est)
    raise _too_small(est.device_bytes + held[p], models, best_floor, budget_bytes, b)


def _models(model, batch, est, common, spec, precision: str, b: int, say):
    """The memory and time models of one precision, from its plain trace and a second one at
    half the batch (memory_model Note 2; the second needs no allocator replay)."""
    half = None
    if b > 1:
        say(f"tracing the plain step ({precision}, batch {b // 2})")
        half = estimate(model, _first(batch, b // 2), precision=precision,
                        allocator_replay=False, **common)
    memory = MemoryModel(est, b, half)
    return memory, TimeModel(est, spec, precision, b, memory, half)


def _first(batch, n: int):
    """The first ``n`` samples, in storages of their own (a view would count the whole)."""
    part = Accumulation(Accumulation.Config(n)).split(batch)[0]
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, part)


def _constraints(model: nn.Module, k: Knobs, b: int) -> Constraints:
    modes = None
    if k.checkpoint is not None or k.offload is not None:
        per = resolve_policy(model, k.checkpoint or "none", "recompute", "Checkpoint")
        off = resolve_policy(model, k.offload or "none", "offload", "Offload")
        modes = tuple("offload" if off.get(n) == "offload" else m for n, m in per.items())
    m = k.micro_batch_size
    return Constraints(None if m is None else min(m, b), modes, k.offload_optimizer)


def _baseline_s(models, user: str, b: int) -> float:
    """Seconds of the plain step at the user's precision (Note 3, time_model Note 5)."""
    if user in models:
        memory, time = models[user]
    else:
        (memory, time), = models.values()
        time = time.widened(user)
    return time.step_s(b, b, ("keep",) * len(memory.blocks), False)


def _as_choice(model_pair, precision: str, b: int, est) -> Choice:
    memory, time = model_pair
    modes = ("keep",) * len(memory.blocks)
    return Choice(precision, b, modes, False, est.peak_bytes, est.device_bytes,
                  time.step_s(b, b, modes, False))


def _knob_values(choice: Choice, blocks: list[str], k: Knobs | None = None) -> dict:
    """The Knobs that apply ``choice`` (per-block modes as policies or tuples of names); the
    caller's own ``checkpoint``/``offload`` where they fixed them (they may name modules that
    are not blocks, or recompute and offload one block, which the search only mirrors)."""
    def policy(kinds: dict[str, str]) -> str | tuple[str, ...]:
        if not kinds:
            return "none"
        if len(kinds) == len(blocks) and len(set(kinds.values())) == 1:
            return "selective" if "selective" in kinds.values() else "all"
        return tuple(f"{n}:selective" if v == "selective" else n for n, v in kinds.items())

    recompute = {n: m for n, m in zip(blocks, choice.modes) if m in ("recompute", "selective")}
    offload = {n: m for n, m in zip(blocks, choice.modes) if m == "offload"}
    out = dict(micro_batch_size=choice.micro_batch_size, checkpoint=policy(recompute),
               offload=policy(offload), offload_optimizer=choice.offload_optimizer)
    if k is not None and (k.checkpoint is not None or k.offload is not None):
        out.update(checkpoint=k.checkpoint or "none", offload=k.offload or "none")
    return out


def _held_bytes(batch, precision: str) -> int:
    """Bytes of the caller's batch the step does not use but ``runner.step(batch)`` keeps alive
    beside it (Note 4): an all-ones mask that is dropped, bf16-pure's fp32 originals."""
    used = Precision(Precision.Config(precision)).prepare_batch(prepare_batch(batch))
    kept = {st._cdata for t in tree_leaves(used) if isinstance(t, torch.Tensor)
            for st in storages_of(t)}
    seen, total = set(), 0
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            for st in storages_of(t):
                if st._cdata not in kept and st._cdata not in seen:
                    seen.add(st._cdata)
                    total += st.nbytes()
    return total


def _describe(choice: Choice, b: int) -> str:
    counts = {m: choice.modes.count(m) for m in set(choice.modes) if m != "keep"}
    parts = [choice.precision, f"micro-batch {choice.micro_batch_size} of {b}"]
    parts += [f"{n} block(s) {m}" for m, n in sorted(counts.items())]
    if choice.offload_optimizer:
        parts.append("optimizer state on the host")
    return ", ".join(parts)


def _make_plan(k: Knobs, choice: Choice, est, model_pair, spec, budget_bytes: int,
               baseline_s: float, best_floor: Choice, b: int, reasons: list[str],
               held: int) -> Plan:
    memory, time = model_pair
    values = _knob_values(choice, memory.blocks, k)
    knobs = k.replace(precision=choice.precision, **values)
    m, n = choice.micro_batch_size, -(-b // choice.micro_batch_size)
    costs = [{"name": name, "mode": mode,
              "saved_bytes": int(memory.saved_bytes(i, mode, m)),
              "time_s": time.mode_s(i, mode, m, n, b)}
             for i, (name, mode) in enumerate(zip(memory.blocks, choice.modes))]
    opt = est.phases.get("optimizer")
    opt_bytes = None
    if opt is not None and 0 < opt < len(est.timeline):
        opt_bytes = max(est.timeline[opt:]) - est.timeline[opt - 1]
    p = Plan(knobs, blocks=dict(zip(memory.blocks, choice.modes)),
             predicted_peak_bytes=est.peak_bytes + held,
             predicted_reserved_bytes=est.reserved_bytes + held,
             predicted_device_bytes=est.device_bytes + held,
             predicted_step_time_ratio=choice.step_s / baseline_s, device=spec.name,
             budget_bytes=budget_bytes, predicted_optimizer_step_bytes=opt_bytes, batch_size=b,
             floor_bytes=min(best_floor.device_bytes, est.device_bytes) + held,
             block_costs=costs)
    in_opt = spec.kind == "cuda" and memory.peak_phase() == "optimizer"   # foreach on CUDA
    p.reasons += reasons + _global_reasons(k, choice, memory, b, in_opt)
    return p


def _global_reasons(k: Knobs, choice: Choice, memory, b: int,
                    plain_peak_in_optimizer: bool) -> list[str]:
    out = []
    if k.precision == "auto":
        out.append(f"precision {choice.precision}: auto takes the GPU's 16-bit autocast (as fast "
                   "or faster matmuls, half the activation bytes); fp32 on a CPU")
    if choice.micro_batch_size < b:
        n = -(-b // choice.micro_batch_size)
        out.append(f"micro-batch {choice.micro_batch_size} x {n} accumulated: the largest "
                   "micro-batch the fastest plan could afford (each extra micro-batch repeats "
                   "the launches and weight reads)")
    changed = [m for m in choice.modes if m != "keep"]
    if changed:
        counts = ", ".join(f"{changed.count(m)} {m}" for m in ("recompute", "selective", "offload")
                           if m in changed)
        out.append(f"blocks: {counts} of {len(choice.modes)}: the mix of modes that costs the "
                   "least predicted time (exact MILP over every block) while every peak point "
                   "stays under the cap; the table shows what each saves and pays")
    if choice.offload_optimizer and plain_peak_in_optimizer:
        out.append("the plain step peaks in the optimizer step (a foreach optimizer's "
                   "temporaries are parameter-sized): a fused optimizer (e.g. "
                   "torch.optim.AdamW(fused=True) on CUDA) or foreach=False would lower that "
                   "peak without moving the state to the host; plan again with it")
    if choice.offload_optimizer:
        out.append("optimizer state on the host: the optimizer step runs on the CPU, which "
                   f"frees {format_bytes(memory.optimizer_state_bytes)} of device memory that no "
                   "recompute or offload of activations could")
    return out


def _too_small(floor_bytes: int, models, best_floor: Choice, budget_bytes: int,
               b: int) -> BudgetTooSmall:
    """The floor (re-traced) and the levers beyond memfit's knobs."""
    memory = models[best_floor.precision][0]
    state = memory.optimizer_state_bytes + memory.grads_bytes
    share = budget_bytes - (floor_bytes - state)
    ranks = math.ceil(state / share) if share > 0 else None
    levers = ["an 8-bit optimizer (e.g. bitsandbytes AdamW8bit) to shrink optimizer state ~4x",
              "shorter sequences (memfit plan --max-seq-len auto)"]
    if ranks and ranks > 1:
        levers.append(f"sharding (FSDP) over about {ranks} GPUs")
    return BudgetTooSmall(
        f"nothing memfit can do fits {format_bytes(budget_bytes)}: the least device memory "
        f"any plan needs is {floor_bytes / GiB:.3g} GiB ({format_bytes(floor_bytes)}: "
        f"{_describe(best_floor, b)}). Levers beyond this step's knobs: {'; '.join(levers)}",
        floor_bytes=floor_bytes, budget_bytes=budget_bytes)
