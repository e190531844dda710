"""The per-layout models of a sharded plan, shared by ``memfit.plan(gpus=...)``
(``api._plan_sharded``) and ``api._compare_gpus``: the knobs checked, the one single-device
trace, its memory and time models per layout, the search of one layout, and the fewest GPUs
that fit. How a sharded plan is made: docs/techniques/sharding.md.

Note 1 (a trace on a card). ``card``: the GPU the trace was made for (``_trace(on_card=)``,
``--compare-gpus``), its allocated bytes counting its workspaces. Each card's rows hold what
that trace holds, with that card's workspaces in place of the traced card's. The one-GPU layout
also keeps the traced ratio of reserved to allocated bytes (the ratio the single-device planner
takes for every configuration), so the traced card's one-GPU row is ``estimate``'s plain step
there. A layout of several GPUs counts allocated bytes, as its re-trace does
(``estimate_sharded``, whose caching allocator is not modelled yet): the traced ratio is not a
rank's (a tiny model's 2 MiB segments put it near 3 and would refuse every layout). A CPU trace
(``card`` None) counts allocated bytes everywhere, the card's workspaces added.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from memfit.api._plan_parts import modelled_impl
from memfit.api._rank_layout import refuse_fsdp_knobs_with_ddp
from memfit.api._setup import resolve_device, resolve_precision
from memfit.api._validate import check_batch
from memfit.api.estimate import estimate
from memfit.knobs import Knobs
from memfit.modes import Mode
from memfit.optimizers import OptimizerRecipe

# what a sharded step runs here: fp32, or bf16 autocast (fp16's GradScaler and bf16-pure are
# not supported under FSDP2 in memfit)
SHARDED_PRECISIONS = ("fp32", "bf16")
from memfit.planner.memory_model import MemoryModel
from memfit.planner.choice import Constraints
from memfit.planner.search import search
from memfit.planner.sharding import Candidate, ShardedTime, shard_estimate, state_bytes
from memfit.planner.time_model import TimeModel
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.trace.card import fixed_bytes, step_workspace_bytes

__all__ = ["Row", "fewest", "SHARDED_PRECISIONS"]


@dataclass
class Row:
    """One layout as the models (and, for the chosen one, the re-trace) predict it."""

    candidate: Candidate
    rank_batch: int
    choice: object | None            # planner.search.Choice, None: nothing fits
    floor_bytes: int = 0             # a lower bound: the rank's sharded state alone


def _setup(model, batch, optimizer, device, loss_fn, knobs: dict, step, scheduler):
    k = Knobs.from_kwargs(**knobs)
    k.check_combinations()                  # what no technique runs yet, gpus included
    for name, value in (("step", step), ("scheduler", scheduler)):
        if value is not None:
            raise ValueError(f"{name} with gpus/sharding is not supported yet: plan the "
                             f"sharded step without {name}")
    if k.remat or k.offload_optimizer or k.offload_params or \
            k.optimizer_state not in (None, "fp32"):
        raise ValueError("remat, offload_optimizer, offload_params and low-bit "
                         "optimizer_state are not weighed with sharding yet (estimate_sharded "
                         "refuses them): plan without them")
    spec = resolve_device(model, device)
    refuse_fsdp_knobs_with_ddp(k)
    if k.mp_policy and k.precision == "bf16":
        raise ValueError("precision='bf16' (autocast) and mp_policy='bf16' both cast the "
                         "compute: pick one (mp_policy='bf16' is FSDP2's; leave precision "
                         "unset or 'fp32' with it)")
    # "auto": the 16-bit autocast the card has
    p = resolve_precision("bf16" if k.mp_policy else k.precision, spec)
    if p == "fp16" and k.precision == "auto":
        p = "fp32"
    if p not in SHARDED_PRECISIONS:
        raise ValueError(f"precision={p!r} with sharding: use 'fp32' or 'bf16' (autocast; "
                         "fp16's GradScaler and bf16-pure are not supported under FSDP2 here)")
    batch = prepare_batch(batch)
    check_batch(model, batch, loss_fn)
    return k, spec, p, batch


def _trace(model, batch, optimizer, loss_fn, count_fn, k: Knobs, p: str, say, spec,
           on_card: bool = False):
    """The one plain single-device trace a sharded plan's models are read from, on the CPU (as
    estimate_sharded's), with the optimizer implementation ``spec`` runs: on a GPU torch's
    default is ``foreach``, whose temporaries span every parameter (the CPU's is the for-loop;
    a GPU rank steps ``foreach`` too, ``api._traced``). ``on_card``: traced for ``spec``
    itself, as ``estimate`` traces one GPU (its CUDA models and the caching allocator's
    replay: Note 1)."""
    say(f"tracing the plain step on one device ({p}, batch {batch_size_of(batch)})")
    recipe = OptimizerRecipe(optimizer, impl=k.optimizer_impl)
    params = [q for q in model.parameters() if q.requires_grad]
    impl = k.optimizer_impl if recipe.instance is not None else \
        modelled_impl(recipe, params, spec)         # an instance keeps its own
    return estimate(model, batch, optimizer=optimizer,
                    device=spec if on_card and spec.kind == "cuda" else "cpu", loss_fn=loss_fn,
                    count_fn=count_fn, precision=p, max_grad_norm=k.max_grad_norm,
                    zero_grad=k.zero_grad, optimizer_impl=impl)


class _Models:
    """Memory and time models per layout, from the one trace (cached per card class;
    ``card``: the GPU it was traced for, Note 1)."""

    def __init__(self, est, p: str, b: int, card=None):
        self.est, self.p, self.b, self.card = est, p, b, card
        self._ratio = est.reserved_bytes / max(est.peak_bytes, 1) if card is not None else 1.0
        self._memory: dict = {}
        self._time: dict = {}

    def memory(self, cand: Candidate, extra: int, context: int) -> MemoryModel:
        key = (cand, extra, context)
        if key not in self._memory:
            one = cand.gpus == 1 and cand.sharding == "none"          # Note 1
            sh = shard_estimate(self.est, cand, extra, context, self._ratio if one else 1.0)
            self._memory[key] = MemoryModel(sh, self.b), sh
        return self._memory[key]

    def pair(self, cand: Candidate, spec):
        extra, context = fixed_bytes(spec, self.est.op_log)
        if self.card is not None:           # its own workspaces are in the trace (Note 1)
            extra -= step_workspace_bytes(self.card)
        memory, sh = self.memory(cand, extra, context)
        if spec.name not in self._time:     # per-op costs: the same for every layout
            self._time[spec.name] = TimeModel(sh, spec, self.p, self.b, memory)
        time = copy.copy(self._time[spec.name])
        time.memory = memory                # the layout's bytes (offload, gradients)
        return memory, ShardedTime(time, self.est, cand, spec, 2 if cand.mp_policy else 4)

    def single_s(self, spec) -> float:
        """The plain step of the whole batch on one device (the ratio's baseline)."""
        memory, time = self.pair(Candidate(1, "none"), spec)
        return time.step_s(self.b, self.b, (Mode.KEEP,) * len(memory.blocks), False)


def _search_row(models: _Models, cand: Candidate, spec, budget: int, k: Knobs, fixed_modes,
                margin: int = 0, probe: bool = False) -> Row:
    """The fastest configuration of ``cand`` predicted to fit; ``probe``: any one that fits,
    tried at the micro-batch sizes that can need least (1 and the rank's batch, which holds no
    gradient during the forward)."""
    b = models.b
    rb = -(-b // cand.gpus)
    memory, time = models.pair(cand, spec)
    floor = 0 if cand.offload else \
        int(state_bytes(models.est) / (cand.gpus if cand.sharding == "fsdp" else 1))
    m = k.micro_batch_size
    fixed = Constraints(None if m is None else min(m, rb), fixed_modes,
                        k.offload_optimizer if cand.sharding == "none" else False)
    if floor > budget:
        return Row(cand, rb, None, floor)
    key = (models.p, k.optimizer_impl)
    pair = {key: (memory, time)}
    margins = {key: margin} if margin else None
    if probe and m is None:
        for size in sorted({1, rb}):
            choice = search(pair, rb, budget, dataclasses.replace(fixed, micro_batch_size=size),
                            margins)
            if choice is not None:
                return Row(cand, rb, choice, floor)
        return Row(cand, rb, None, floor)
    return Row(cand, rb, search(pair, rb, budget, fixed, margins), floor)


def fewest(counts: list[int], fits) -> int | None:
    """The least of ``counts`` (ascending) where ``fits(n)``, by bisection: a rank's bytes never
    grow with the count, so neither does what fits. None: not even the last."""
    lo, hi = 0, len(counts) - 1
    if not counts or not fits(counts[hi]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(counts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return counts[lo]
