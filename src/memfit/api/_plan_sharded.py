"""``memfit.plan(gpus=N | "auto", sharding=...)``: how many GPUs, which data-parallel layout, and
the per-block plan of each rank (``api._compare_gpus`` asks it of every GPU in the table).

Note 1 (the batch). ``batch`` is the effective batch of the whole job, split over the ranks as
data parallelism does (the same training as on one device): each rank runs ``ceil(b / N)``
samples (the largest rank's share where N does not divide b), so N is at most b. The plan's
``batch_size`` is the rank's; ``memfit.fit`` inside each rank takes that rank's batch.

Note 2 (traces). One plain single-device trace (at b, at the searched precision) gives the
models: the state fixed, activations and per-sample time proportional to the batch
(``memory_model``, ``time_model``); every candidate layout is a rescaling of it
(``planner.sharding``), searched by the single-device MILP at the rank's batch. A second
trace at b // 2 (which ``memfit.plan`` reads for the line through both) costs Llama-2-7B 15 s
and, measured at batch 8 x 2048 in bf16, changed neither layout's answer (6 RTX 4090, 3
A100-40GB) and the modelled bytes of the 4090 answer by 0.3% (23.97 -> 23.91 GiB; re-traced
22.79 / 22.87 GiB): the re-trace (Note 3) is the answer either way. The traces are CPU traces, as
``estimate_sharded``'s are for any target (``api._sharded``), so model and verification
count the same things: allocated bytes, plus the card's cuBLAS workspaces and CUDA context
(``extra``, ``context``). The CUDA autocast / SDPA / caching-allocator models and NCCL's own
buffers (outside the allocator) are not applied under sharding yet; a note says so.

Note 3 (verification). The layout chosen (fewest GPUs for "auto", then the fastest) is
re-traced by ``estimate_sharded`` with its per-block modes and micro-batch: that trace is the
answer. The fewest GPUs predicted to fit are found by bisection over the counts (``_sharded_models.fewest``): one
rank's bytes never grow with the count (its share of the state, and of the batch, only
shrink; the unsharded buffers stay), so neither does what fits. Larger counts are searched
only when the re-traces at the fewest miss. If it misses the budget the search runs again with the cap lowered by what was
missing (as ``memfit.plan``), then moves to the next layout. One GPU is
``memfit.plan``'s question: when the models say a single device may fit, it is asked.

Note 4 (what is weighed). Precision (fp32, or bf16 autocast; "auto" takes bf16 where the card
has it: FSDP2 here does not run fp16's GradScaler), micro-batch size, per-block keep /
recompute / selective / offload, the layout, and for a GPU FSDP2's CPU offload (sharded
state on the host, ``planner.sharding``; re-traced as ``trace.fsdp_offload`` places
it), searched only where no layout without it fits unless ``fsdp_offload=True`` is asked for
(``layout_tiers``: the search runs tier by tier, the rows of the earlier tiers kept for the
plan's reasons). Not weighed: memfit's own optimizer-state offload, and ``reshard_after_forward`` as a
group size (it may be fixed, not searched).

Note 5 (every card). ``api._compare_gpus`` searches the same models for each GPU of the table,
without the re-trace.

Note 6 (FSDP2's mixed precision). Where the precision searched is bf16, every FSDP2 layout is
weighed twice: with bf16 autocast (precision "bf16") and with FSDP2's own
``MixedPrecisionPolicy(bf16, reduce fp32)`` (``mp_policy="bf16"``, precision "fp32": no
autocast), whose unsharded parameters are half and whose all-gathers move half the bytes
(``planner.sharding``). Under autocast a bf16 copy of every block's weights lives from
the forward to the backward (``planner.sharding``); under the policy it does not, so on
large models the policy fits where autocast does not (Llama-2-7B, batch 8 x 2048, on 24 GB
cards). ``mp_policy="bf16"`` given by the caller weighs it alone (FSDP2 only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from memfit.api._choice import describe, knob_values
from memfit.api._floor import first_samples
from memfit.api._sharded import estimate_sharded
from memfit.api._sharded_models import (Row, _Models, _search_row, _setup, _trace,
                                        fewest)
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.planner import Plan
from memfit.planner.choice import Constraints
from memfit.planner.build import block_costs, build_plan
from memfit.planner.sharding import Candidate, interconnect, layout_tiers
from memfit.planner.verify import ATTEMPTS, Margins
from memfit.techniques.accumulation import batch_size_of
from memfit.trace.card import fixed_bytes
from memfit.units import format_bytes, parse_bytes

__all__ = ["plan_sharded", "plan_sharded_traced", "ShardedPlanned"]

_SHARD_KNOBS = ("gpus", "sharding", "reshard_after_forward", "fsdp_offload", "mp_policy")


def is_sharded(knobs: dict) -> bool:
    """Whether ``plan(**knobs)`` asks for several GPUs (routing in ``api.plan``)."""
    return knobs.get("gpus") not in (None, 1) or knobs.get("sharding") not in (None, "none") \
        or knobs.get("reshard_after_forward") is not None or bool(knobs.get("fsdp_offload")) \
        or knobs.get("mp_policy") is not None


@dataclass
class ShardedPlanned:
    """A sharded plan, its step time in seconds, and every layout weighed."""

    plan: Plan
    step_s: float
    candidate: Candidate
    rows: list[Row] = field(default_factory=list)
    verified: object | None = None   # the Estimate of the re-trace
    link: str = ""


def plan_sharded(model: nn.Module, batch, budget=None, optimizer="adamw", device=None,
                 loss_fn: Callable | None = None, **kwargs) -> Plan:
    """``memfit.plan`` with ``gpus=N`` or ``"auto"`` and/or ``sharding`` (module Notes);
    ``plan_one``: the single-device planner (``memfit.api.plan.plan``, which calls this)."""
    return plan_sharded_traced(model, batch, budget, optimizer, device, loss_fn, **kwargs).plan


def _rank_knobs(k: Knobs, row: Row, blocks) -> Knobs:
    values = knob_values(row.choice, blocks, k)
    values = {n: v for n, v in values.items() if n in Knobs.__dataclass_fields__}
    c = row.candidate
    return k.replace(precision="fp32" if c.mp_policy else row.choice.precision, **values,
                     gpus=c.gpus, sharding=c.sharding,
                     reshard_after_forward=c.reshard_after_forward if c.sharding == "fsdp"
                     else None, fsdp_offload=c.offload if c.sharding == "fsdp" else None,
                     mp_policy=c.mp_policy)


def plan_sharded_traced(model: nn.Module, batch, budget=None, optimizer="adamw", device=None,
                        loss_fn: Callable | None = None, *, count_fn: Callable | None = None,
                        on_progress: Callable[[str], None] | None = None, step=None,
                        scheduler=None, floor: bool = False, allocator=None,
                        allow_numerics_change: bool | None = None,
                        plan_one: Callable[..., Plan], **knobs) -> ShardedPlanned:
    """The fewest GPUs (``gpus="auto"``) or the given count, the fastest layout and per-rank
    plan predicted to fit ``budget`` per GPU, verified by ``estimate_sharded`` (Notes).
    ``plan_one(model, batch, budget, optimizer, device, loss_fn, **knobs)``: the single-device
    planner, for a layout of one GPU (``memfit.api.plan.plan``; passed in, as it calls this)."""
    say = on_progress or (lambda message: None)
    k, spec, p, batch = _setup(model, batch, optimizer, device, loss_fn, knobs, step, scheduler)
    budget_bytes = parse_bytes(budget) if budget is not None else spec.usable_bytes
    b = batch_size_of(batch)
    if isinstance(k.gpus, int) and k.gpus > b:
        raise ValueError(f"gpus={k.gpus}: the batch has {b} samples, split over the ranks "
                         f"(memfit.api._plan_sharded Note 1); use gpus <= {b} or a larger batch")
    models = _Models(_trace(model, batch, optimizer, loss_fn, count_fn, k, p, say, spec), p,
                     b)
    fixed_modes = Constraints.of(model, k, b).modes        # the caller's fixed per-block modes
    before: list[Row] = []          # the rows of the tiers searched before (Note 4)

    def search_in(cands: list[Candidate]):
        """(the plan, the rows weighed), or (None, the rows) when nothing in ``cands`` fits."""
        counts = sorted({c.gpus for c in cands})

        def at(n: int, probe: bool = False) -> list[Row]:
            return [_search_row(models, c, spec, budget_bytes, k, fixed_modes, probe=probe)
                    for c in cands if c.gpus == n]

        say("searching layouts")
        probed: dict[int, list[Row]] = {}

        def fits(n: int) -> bool:
            probed[n] = at(n, probe=True)
            return any(r.choice is not None for r in probed[n])

        first = fewest(counts, fits)
        pending = [n for n in reversed(counts) if first is not None and n > first]
        rows: list[Row] = at(first) if first is not None else probed[counts[-1]]
        margins = Margins(budget_bytes, drop_after=ATTEMPTS)      # planner.verify
        for _ in range(len(cands) * (ATTEMPTS + 1)):
            fitting = [r for r in rows if r.choice is not None]
            if not fitting and pending:          # re-traces missed: the next count (Note 3)
                rows += at(pending.pop())
                continue
            if not fitting:
                break
            n = min(r.candidate.gpus for r in fitting)
            best = min((r for r in fitting if r.candidate.gpus == n),
                       key=lambda r: r.choice.step_s)
            c = best.candidate
            if c.sharding == "none":              # one GPU: memfit.plan's question (Note 3)
                say("one GPU may fit: planning it")
                single = {n: v for n, v in k.to_dict().items()
                          if v is not None and n not in _SHARD_KNOBS}
                try:
                    one = plan_one(model, batch, budget_bytes, optimizer, spec, loss_fn,
                                   count_fn=count_fn, **single)
                except BudgetTooSmall:
                    rows = [r for r in rows if r is not best]
                    continue
                return ShardedPlanned(one, best.choice.step_s, c, rows, None, ""), rows
            say(f"verifying: re-tracing one rank of {c.describe()}, "
                f"{describe(best.choice, best.rank_batch)}")
            verified = _verify(model, batch, optimizer, spec, loss_fn, count_fn, k, best,
                               models.memory(c, *fixed_bytes(spec, models.est.op_log))[0].blocks)
            device_bytes = verified.device_bytes          # _sharded
            if device_bytes <= budget_bytes:
                return _planned(k, best, verified, device_bytes, models, spec, budget_bytes,
                                before + rows, margins.get(c)), rows
            retry = margins.missed(c, device_bytes, best.choice.device_bytes)
            rows[rows.index(best)] = _search_row(models, c, spec, budget_bytes, k, fixed_modes,
                                                 margins.get(c)) if retry else \
                Row(c, best.rank_batch, None, best.floor_bytes)
        return None, rows

    for cands in layout_tiers(k, k.gpus, b, p, spec):
        planned, tier_rows = search_in(cands)
        if planned is not None:
            return planned
        before += tier_rows
    rows = before
    least = min((r.floor_bytes for r in rows if not r.candidate.offload), default=0)
    most = max((r.candidate.gpus for r in rows), default=1)
    offload = " (with FSDP2's CPU offload too)" if any(r.candidate.offload for r in rows) else ""
    raise BudgetTooSmall(
        f"no layout of up to {most} GPU(s){offload} fits {format_bytes(budget_bytes)} per GPU: the "
        f"batch of {b} splits over at most {b} ranks (memfit.api._plan_sharded Note 1), and "
        f"even then each rank's sharded parameters, gradients and optimizer state need "
        f"{format_bytes(least)} before activations. Levers: a larger batch (more ranks), a "
        "card with more memory, an 8-bit optimizer state, freezing parameters or LoRA",
        floor_bytes=least, budget_bytes=budget_bytes)


def _verify(model, batch, optimizer, spec, loss_fn, count_fn, k: Knobs, row: Row, blocks):
    rk = _rank_knobs(k, row, blocks)
    c = row.candidate
    part = batch if row.rank_batch == batch_size_of(batch) else first_samples(batch,
                                                                             row.rank_batch)
    rest = {n: v for n, v in rk.to_dict().items()
            if v is not None and n not in _SHARD_KNOBS + ("offload_optimizer",)}
    return estimate_sharded(model, part, optimizer, spec, loss_fn, world_size=c.gpus,
                            sharding=c.sharding, reshard_after_forward=c.reshard_after_forward,
                            mp_policy=c.mp_policy, fsdp_offload=c.offload, count_fn=count_fn,
                            **rest)


def _planned(k, row: Row, verified, device_bytes: int, models: _Models, spec, budget: int,
             rows: list[Row], margin: int) -> ShardedPlanned:
    c, choice = row.candidate, row.choice
    memory, time = models.pair(c, spec)
    knobs = _rank_knobs(k, row, memory.blocks)
    link, rate = interconnect(spec)
    baseline = models.single_s(spec)
    comm = time.comm_s(choice.micro_batch_size, row.rank_batch)
    fewer = list(range(1, c.gpus))          # none fits there (bisection, Note 3)
    why = [f"{c.describe()}: each rank runs {row.rank_batch} of the batch's {models.b} samples "
           f"(memfit.api._plan_sharded Note 1)"]
    if fewer and k.gpus in (None, "auto"):
        why.append(f"the fewest GPUs predicted to fit: {', '.join(map(str, fewer))} GPU(s) "
                   "do not (each rank's state and activations exceed the budget)")
    others = [r for r in rows if r.candidate.gpus == c.gpus and r is not row]
    for r in others:
        what = "does not fit" if r.choice is None else \
            f"{r.choice.step_s:.3g} s predicted, slower"
        why.append(f"{r.candidate.describe()}: {what}")
    why.append(f"collectives over {link} ({rate / 1e9:.0f} GB/s one direction, "
               f"planner.sharding): {comm:.3g} s per step not hidden by compute (Note 3)")
    why.append(f"predicted step time {choice.step_s:.3g} s per effective batch of {models.b}; "
               f"one GPU's plain step of the whole batch would take {baseline:.3g} s (modelled)")
    if c.offload:
        host = verified.host_peak_bytes
        why.append(f"FSDP2's CPU offload: the sharded state and the optimizer step on the host, "
                   f"{format_bytes(host)} of host RAM per rank at its peak, "
                   f"{format_bytes(host * c.gpus)} for {c.gpus} ranks on one machine "
                   "(planner.sharding)")
    if margin:
        why.append(f"the first choice re-traced over the budget; searched again "
                   f"{format_bytes(margin)} tighter")
    why.append("per-rank figures: estimate_sharded's CPU trace plus the card's cuBLAS "
               "workspaces and CUDA context; CUDA's allocator rounding and NCCL's buffers are "
               "not modelled under sharding yet (memfit.api._plan_sharded Note 2)"
               if spec.kind == "cuda" else "per-rank figures: estimate_sharded's trace (exact "
               "on the CPU against real gloo runs)")
    costs = block_costs(memory, time, choice.modes, choice.micro_batch_size, row.rank_batch)
    plan = build_plan(knobs, memory.blocks, choice.modes, verified, batch_size=row.rank_batch,
                      ratio=choice.step_s / baseline, device=spec.name, budget_bytes=budget,
                      reasons=why, device_bytes=device_bytes, costs=costs)
    return ShardedPlanned(plan, choice.step_s, c, rows, verified, link)
