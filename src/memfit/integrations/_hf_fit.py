"""``fit(trainer, budget)``: the fastest configuration of ``trainer.train()`` predicted to fit,
planned per block by memfit's planner and applied to the trainer.

Note 1 (the search space: the planner's). ``memfit.plan`` weighs, for a user step, one mode per
block (keep / recompute / selective / offload) and the optimizer state's placement
(``api.plan``); for the Trainer the micro-batch is also ours to choose, because it is a
TrainingArguments setting the step reads: any divisor ``m`` of the effective batch
``per_device_train_batch_size x gradient_accumulation_steps`` up to the user's micro-batch, with
the accumulation raised to keep the effective batch. So a plan may recompute 5 of 12 blocks,
offload one and keep the rest, where a uniform mode would recompute all 12. The models, the
MILP and the verification are the planner's, run over the Trainer's real step
(``_hf_plan``). A trainer that already checkpoints with transformers' own
activation checkpointing keeps it (its blocks take no memfit hooks then).

Note 2 (numerics). By default the precision is the user's: fit changes where bytes live and
how the batch is split, never the numerics of a step. ``precision="auto"`` allows the 16-bit
precision the target device has (bf16, else fp16, on a GPU; a CPU target keeps fp32, as
``memfit.plan``'s auto does), weighed beside the user's own by the same models;
``precision="bf16"`` / ``"fp16"`` asks for that one. A chosen precision is set in the
TrainingArguments (``bf16`` / ``fp16`` / ``mixed_precision``) and the trainer's accelerator is
rebuilt at it (``_hf_precision``): that is what ``train()`` autocasts with. Under
"auto" a trainer that fits as configured is left as it is.

Note 3 (applying). TrainingArguments are set on ``trainer.args`` (and the trainer's cached
batch size); the plan's per-block modes and optimizer placement are applied as ``memfit.plan``'s
are to any framework's loop (``_apply.apply_plan``: ``techniques.checkpoint`` /
``techniques.offload`` hooks on ``trainer.model``, nothing replaced; memfit's offloaded optimizer
over the optimizer ``args.optim`` makes, set as ``trainer.optimizer``, which ``train()`` then
uses as given; an LR scheduler given to the Trainer was built on the old optimizer, so
optimizer offload is not considered then). ``Changes.remove`` undoes all of it. With fp32
parameters recompute and offload change no value: losses and weights are bitwise those of the
unplanned run; a smaller micro-batch sums the same per-token losses in another order (float
tolerance).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from memfit.api._setup import resolve_device
from memfit.api.estimate import Estimate
from memfit.errors import BudgetTooSmall
from memfit.integrations._apply import apply_plan
from memfit.integrations._hf_plan import Candidate, TrainerModels, set_args, trace
from memfit.integrations._hf_precision import precisions_for, rebuild, unwrap_autocast, \
    user_precision
from memfit.integrations._hf_step import check_supported, trainer_optimizer
from memfit.knobs import Knobs
from memfit.planner import Plan
from memfit.planner.build import build_plan
from memfit.units import format_bytes, parse_bytes

__all__ = ["fit", "Changes", "Candidate"]


@dataclass
class Changes:
    """What ``fit`` changed on the trainer, and the prediction behind it."""

    candidate: Candidate
    args: dict[str, tuple]                 # TrainingArguments name -> (before, after)
    blocks: dict[str, str]                 # block -> mode installed by hooks
    optimizer_offloaded: bool
    predicted_peak_bytes: int              # allocated peak of the chosen step (the trace)
    predicted_device_bytes: int            # what the budget is checked against
    plain_device_bytes: int                # the trainer as it was
    predicted_step_time_ratio: float       # vs the trainer as it was (time model)
    budget_bytes: int
    traced: int                            # traces run (_hf_plan)
    estimate: Estimate = field(repr=False)
    plan: Plan | None = field(default=None, repr=False)    # memfit's Plan of it (explain())
    floor_bytes: int | None = None         # the least traced, where traced (_hf_plan)
    models: TrainerModels | None = field(default=None, repr=False)   # what planned it
    _undo: list = field(default_factory=list, repr=False)

    @property
    def changed(self) -> bool:
        return bool(self.args or self.optimizer_offloaded or
                    any(m != "keep" for m in self.blocks.values()))

    def __str__(self) -> str:
        head = (f"memfit: {format_bytes(self.predicted_device_bytes)} predicted under the "
                f"budget {format_bytes(self.budget_bytes)} (as configured: "
                f"{format_bytes(self.plain_device_bytes)})")
        if not self.changed:
            return head + "; nothing changed"
        lines = [head, f"  {self.candidate.describe()}; predicted step time "
                       f"x{self.predicted_step_time_ratio:.2f}"]
        lines += [f"  args.{k}: {a!r} -> {b!r}" for k, (a, b) in self.args.items()]
        counts = {}
        for m in self.blocks.values():
            if m != "keep":
                counts[m] = counts.get(m, 0) + 1
        if counts:
            hooked = ", ".join(f"{n} {m}" for m, n in sorted(counts.items()))
            lines.append(f"  block hooks: {hooked} (of {len(self.blocks)} blocks)")
        if self.optimizer_offloaded:
            lines.append("  trainer.optimizer: memfit's OffloadedOptimizer (state on host)")
        return "\n".join(lines)

    def remove(self) -> None:
        """Undo: hooks off, arguments, optimizer and accelerator back as they were (a changed
        precision: the autocast a ``train()`` since wrapped the forward in comes off too)."""
        while self._undo:
            self._undo.pop()()


def fit(trainer, budget, device=None, *, micro_batch_size: int | None = None,
        offload_optimizer: bool | None = None, precision: str | None = None,
        verbose: bool = True, on_progress=None) -> Changes:
    """Plan ``trainer.train()`` under ``budget`` device bytes and apply the plan (Notes 1-3).

    ``budget``: bytes or "11GiB"; ``device`` as in ``estimate``. ``micro_batch_size`` /
    ``offload_optimizer`` fix those choices (None: memfit's to make); ``precision``: None (the
    arguments' own), "auto", "bf16" or "fp16" (Note 2). Returns the ``Changes`` (also printed
    unless ``verbose=False``); ``trainer.train()`` then runs as it always does.
    ``on_progress(message)`` hears each trace.
    Raises ``memfit.BudgetTooSmall`` with the least configuration's bytes when nothing fits."""
    say = on_progress or (lambda message: None)
    check_supported(trainer)
    budget_bytes = parse_bytes(budget)
    args = trainer.args
    spec = resolve_device(trainer.model, device)
    precisions = precisions_for(precision, args, spec)
    b, g = args.per_device_train_batch_size, args.gradient_accumulation_steps
    own = Candidate(b, g, (), (), False, user_precision(args),
                    bool(args.activation_checkpointing))
    _check_fixed(own, micro_batch_size, offload_optimizer, trainer)
    if trainer.lr_scheduler is not None:
        offload_optimizer = False           # Note 3: a given scheduler holds the old optimizer
    say(f"tracing the trainer as configured ({own.describe()})")
    plain = trace(trainer, own, device)
    own_allowed = micro_batch_size in (None, b) and not offload_optimizer and \
        own.precision in precisions
    if plain.device_bytes <= budget_bytes and own_allowed:
        return _apply(trainer, own, plain, plain, 1.0, budget_bytes, 1, verbose)
    say("tracing one micro-batch (and half of one) for the planner's models")
    models = TrainerModels(trainer, device, spec, precisions, one=plain if g == 1 else None)
    sizes = [m for m in models.sizes if micro_batch_size in (None, m)]
    found = models.plan(budget_bytes, sizes, offload_optimizer, say)
    floor_bytes = None
    if found is None:
        c, est = models.floor(sizes, offload_optimizer, say)
        floor_bytes = est.device_bytes
        if est.device_bytes > budget_bytes:
            raise _too_small(c, est, budget_bytes)
        why = ["only the least-memory configuration fits"]
    else:
        c, est, attempt = found
        why = [] if attempt == 0 else [
            f"the first {attempt} choice(s) re-traced over the budget; the search ran again "
            "tighter"]
    ratio = models.step_s(c) / models.plain_s()
    return _apply(trainer, c, est, plain, ratio, budget_bytes, 1 + models.traced, verbose,
                  models=models, reasons=why, floor_bytes=floor_bytes)


def _too_small(c: Candidate, est: Estimate, budget_bytes: int) -> BudgetTooSmall:
    return BudgetTooSmall(
        f"nothing memfit can apply to this Trainer fits {format_bytes(budget_bytes)}: the least "
        f"is {format_bytes(est.device_bytes)} ({c.describe()}). Give a larger budget, or make "
        "the step itself smaller (shorter sequences, bf16=True, LoRA)",
        floor_bytes=est.device_bytes, budget_bytes=budget_bytes)


def _check_fixed(own: Candidate, m, offload_optimizer, trainer) -> None:
    total = own.micro_batch_size * own.accumulation
    if m is not None and (not isinstance(m, int) or m < 1 or total % m or m > own.micro_batch_size):
        raise ValueError(f"micro_batch_size={m!r}: give a divisor of the effective batch {total} "
                         f"(per_device_train_batch_size x gradient_accumulation_steps) no larger "
                         f"than per_device_train_batch_size={own.micro_batch_size}, or None")
    if offload_optimizer and trainer.lr_scheduler is not None:
        raise ValueError("offload_optimizer=True: the Trainer was given an LR scheduler built on "
                         "its optimizer, which offloading replaces; pass optimizers=(None, None) "
                         "or a scheduler-free optimizer, or leave offload_optimizer unset")


def _plan_of(c: Candidate, est: Estimate, budget_bytes: int, ratio: float, reasons,
             floor_bytes, device: str) -> Plan:
    """memfit's ``Plan`` of ``c`` for the model and optimizer (what ``apply_plan`` applies)."""
    knobs = Knobs(**c.knobs) if c.blocks else Knobs(offload_optimizer=c.offload_optimizer)
    return build_plan(knobs, c.blocks, c.modes, est, ratio=ratio, device=device,
                      budget_bytes=budget_bytes, batch_size=c.micro_batch_size * c.accumulation,
                      floor_bytes=floor_bytes,
                      reasons=[f"the Trainer: {c.describe()}"] + list(reasons))


def _apply(trainer, c: Candidate, est: Estimate, plain: Estimate, ratio: float,
           budget_bytes: int, traced: int, verbose: bool, *, models=None, reasons=(),
           floor_bytes=None) -> Changes:
    """Note 3."""
    args, undo, changed = trainer.args, [], {}
    before = {k: copy.copy(getattr(args, k)) for k in _ARG_NAMES}
    set_args(args, c)
    for k in _ARG_NAMES:
        if getattr(args, k) != before[k]:
            changed[k] = (before[k], getattr(args, k))
    saved_b = trainer._train_batch_size
    trainer._train_batch_size = args.train_batch_size
    kept = {k: getattr(trainer, k) for k in _ACCELERATOR}

    def restore_args():
        for k, v in before.items():
            setattr(args, k, v)
        trainer._train_batch_size = saved_b
        if "mixed_precision" in changed:          # the shared state, then the trainer's own
            unwrap_autocast(trainer.model)
            rebuild(trainer)
            for k, v in kept.items():
                setattr(trainer, k, v)
    undo.append(restore_args)
    if "mixed_precision" in changed:
        rebuild(trainer)                          # what train() autocasts with (Note 2)
    plan = _plan_of(c, est, budget_bytes, ratio, reasons, floor_bytes,
                    getattr(est.device, "name", str(est.device)))
    blocks = {}
    try:
        if c.offload_optimizer or any(m != "keep" for m in c.modes):
            applied = apply_plan(plan, trainer.model, trainer_optimizer(trainer), budget_bytes,
                                 swap=lambda new: _swap_optimizer(trainer, new))
            undo.extend(applied._undo)
            blocks = {n: m for n, m in applied.blocks.items() if n in plan.blocks}
    except BaseException:
        while undo:
            undo.pop()()
        raise
    out = Changes(candidate=c, args=changed, blocks=blocks, optimizer_offloaded=c.offload_optimizer,
                  predicted_peak_bytes=est.peak_bytes, predicted_device_bytes=est.device_bytes,
                  plain_device_bytes=plain.device_bytes, predicted_step_time_ratio=ratio,
                  budget_bytes=budget_bytes, traced=traced, estimate=est, plan=plan,
                  floor_bytes=floor_bytes, models=models, _undo=undo)
    if verbose:
        print(out)
    return out


def _swap_optimizer(trainer, new):
    """``new`` as the optimizer ``train()`` steps (Note 3); returns the undo."""
    old, trainer.optimizer = trainer.optimizer, new
    return lambda: setattr(trainer, "optimizer", old)


_ARG_NAMES = ("per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
              "mixed_precision")
_ACCELERATOR = ("accelerator", "gather_function", "is_deepspeed_enabled", "is_fsdp_enabled")
