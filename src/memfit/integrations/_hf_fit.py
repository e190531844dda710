"""``fit(trainer, budget)``: the fastest configuration of ``trainer.train()`` predicted to fit,
applied to the trainer.

Note 1 (the search space). A configuration is: the micro-batch ``m`` (any divisor of the
effective batch ``per_device_train_batch_size x gradient_accumulation_steps`` up to the user's
micro-batch, with the accumulation raised to keep the effective batch), the blocks' mode
(all kept; memfit's ``selective`` or ``every:2`` recompute or ``offload`` of every block, by
block hooks; or every block recomputed by transformers' own activation checkpointing, a
TrainingArguments setting) and memfit's optimizer-state offload. The precision is the user's:
fit changes where bytes live and how the batch is split, never the numerics of a step (set
``bf16=True`` yourself for that). A trainer that already checkpoints keeps its checkpointing.

Note 2 (the order, and verification). The least-memory configuration (every block recomputed,
the smallest micro-batch, the optimizer state on host, as far as the fixed choices allow) is
traced first: over the budget, nothing fits, and ``BudgetTooSmall`` gives it as the floor.
Else the configurations are ranked by memfit's time model (``planner.time_model``) read off
one trace of a single micro-batch of the Trainer's step, and traced (``estimate(trainer)``
with the configuration: the same Trainer step the real run takes) fastest first until one
fits; the trace is the answer, on CPU exact. A configuration that needs no less memory than one
already traced over the budget (same mode or all kept, no smaller micro-batch, no more offload)
is skipped without a trace.

Note 3 (applying). TrainingArguments are set on ``trainer.args`` (and the trainer's cached
batch size); block hooks go on ``trainer.model`` (``techniques.checkpoint`` /
``techniques.offload``: nothing on the model is replaced, ``Changes.remove`` takes them off);
the offloaded optimizer (``techniques.optimizer_offload``) is built over the optimizer
``args.optim`` makes (or the trainer's own) and set as ``trainer.optimizer``, which ``train()``
then uses as given (an LR scheduler given to the Trainer was built on the old optimizer, so
optimizer offload is not considered then). With fp32 parameters recompute and offload change no
value: losses and weights are bitwise those of the unplanned run; a smaller micro-batch sums the
same per-token losses in another order (float tolerance).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

from memfit.api._setup import resolve_device
from memfit.api.estimate import Estimate
from memfit.errors import BudgetTooSmall
from memfit.integrations._hf_estimate import estimate
from memfit.integrations._hf_step import check_supported, trainer_optimizer
from memfit.planner.memory_model import MemoryModel
from memfit.planner.time_model import TimeModel
from memfit.techniques.checkpoint import Checkpoint
from memfit.techniques.offload import Offload
from memfit.techniques.optimizer_offload import OptimizerOffload
from memfit.units import format_bytes, parse_bytes

__all__ = ["fit", "Changes", "Candidate"]

MODES = ("keep", "selective", "every:2", "transformers", "offload")


@dataclass(frozen=True)
class Candidate:
    """One configuration of the Trainer's step (Note 1)."""

    micro_batch_size: int        # per_device_train_batch_size
    accumulation: int            # gradient_accumulation_steps
    mode: str                    # one of MODES, for every block
    offload_optimizer: bool

    @property
    def knobs(self) -> dict:
        """What memfit adds through the model and the optimizer (the rest is TrainingArguments)."""
        k = {"offload_optimizer": self.offload_optimizer}
        if self.mode in ("selective", "every:2"):
            k["checkpoint"] = self.mode
        elif self.mode == "offload":
            k["offload"] = "all"
        return k

    def describe(self) -> str:
        words = {"keep": "every block kept", "selective": "selective recompute (memfit hooks)",
                 "every:2": "every 2nd block recomputed (memfit hooks)",
                 "transformers": "activation checkpointing (transformers')",
                 "offload": "saved activations offloaded to host (memfit hooks)"}
        out = [f"micro-batch {self.micro_batch_size} x {self.accumulation}", words[self.mode]]
        if self.offload_optimizer:
            out.append("optimizer state on host")
        return ", ".join(out)


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
    traced: int                            # configurations traced (Note 2)
    estimate: Estimate = field(repr=False)
    _undo: list = field(default_factory=list, repr=False)

    @property
    def changed(self) -> bool:
        return bool(self.args or self.blocks or self.optimizer_offloaded)

    def __str__(self) -> str:
        head = (f"memfit: {format_bytes(self.predicted_device_bytes)} predicted under the "
                f"budget {format_bytes(self.budget_bytes)} (as configured: "
                f"{format_bytes(self.plain_device_bytes)})")
        if not self.changed:
            return head + "; nothing changed"
        lines = [head, f"  {self.candidate.describe()}; predicted step time "
                       f"x{self.predicted_step_time_ratio:.2f}"]
        lines += [f"  args.{k}: {a!r} -> {b!r}" for k, (a, b) in self.args.items()]
        hooked = {m for m in self.blocks.values() if m != "keep"}
        if hooked:
            n = sum(m != "keep" for m in self.blocks.values())
            lines.append(f"  block hooks: {n} of {len(self.blocks)} blocks "
                         f"{'/'.join(sorted(hooked))}")
        if self.optimizer_offloaded:
            lines.append("  trainer.optimizer: memfit's OffloadedOptimizer (state on host)")
        return "\n".join(lines)

    def remove(self) -> None:
        """Undo: hooks off, arguments and optimizer back as they were (activation checkpointing
        that a ``train()`` since turned on stays on the model: transformers'
        ``activation_checkpointing_disable()`` turns it off)."""
        while self._undo:
            self._undo.pop()()


def fit(trainer, budget, device=None, *, micro_batch_size: int | None = None,
        offload_optimizer: bool | None = None, verbose: bool = True) -> Changes:
    """Plan ``trainer.train()`` under ``budget`` device bytes and apply the plan (Notes 1-3).

    ``budget``: bytes or "11GiB"; ``device`` as in ``estimate``. ``micro_batch_size`` /
    ``offload_optimizer`` fix those choices (None: memfit's to make). Returns the ``Changes``
    (also printed unless ``verbose=False``); ``trainer.train()`` then runs as it always does.
    Raises ``memfit.BudgetTooSmall`` with the least configuration's bytes when nothing fits."""
    check_supported(trainer)
    budget_bytes = parse_bytes(budget)
    args = trainer.args
    b, g = args.per_device_train_batch_size, args.gradient_accumulation_steps
    own = Candidate(b, g, "transformers" if args.activation_checkpointing else "keep", False)
    _check_fixed(own, micro_batch_size, offload_optimizer, trainer)
    plain = _trace(trainer, own, device)
    own_allowed = micro_batch_size in (None, b) and not offload_optimizer
    if plain.device_bytes <= budget_bytes and own_allowed:
        return _apply(trainer, own, plain, plain, 1.0, budget_bytes, 1, verbose)
    one = plain if g == 1 else _trace(trainer, Candidate(b, 1, own.mode, False), device)
    time = _time_model(one, args, b)
    allowed = [c for c in _candidates(trainer, own, resolve_device(trainer.model, device))
               if micro_batch_size in (None, c.micro_batch_size)
               and offload_optimizer in (None, c.offload_optimizer)]
    if not allowed:
        raise BudgetTooSmall(f"the trainer as configured needs {format_bytes(plain.device_bytes)}"
                             f", over the budget {format_bytes(budget_bytes)}, and the fixed "
                             "choices leave nothing else to try", floor_bytes=plain.device_bytes,
                             budget_bytes=budget_bytes)
    traced = {}
    floor = min(allowed, key=_memory_rank)       # Note 2: the least-memory one first
    traced[floor] = _trace(trainer, floor, device)
    if traced[floor].device_bytes > budget_bytes:
        raise _too_small(floor, traced[floor], budget_bytes)
    failed = []
    for c in sorted(allowed, key=time):
        if any(_needs_no_less(c, f) for f in failed):
            continue
        est = traced[c] if c in traced else _trace(trainer, c, device)
        traced[c] = est
        if est.device_bytes <= budget_bytes:
            return _apply(trainer, c, est, plain, time(c) / time(own), budget_bytes,
                          len(traced) + 1, verbose)
        failed.append(c)
    raise AssertionError("the least-memory configuration fitted but was not reached")


def _memory_rank(c: Candidate) -> tuple:
    """Sorts the configuration needing the least memory first (full recompute, the smallest
    micro-batch, the optimizer state on host)."""
    order = {"transformers": 0, "selective": 1, "offload": 2, "every:2": 3, "keep": 4}
    return (not c.offload_optimizer, c.micro_batch_size, order[c.mode])


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


def _candidates(trainer, own: Candidate, spec) -> list[Candidate]:
    """Note 1's configurations (the user's own excluded); for a GPU target without
    transformers' checkpointing (``_hf_estimate.check_gpu_checkpointing``)."""
    b, B = own.micro_batch_size, own.micro_batch_size * own.accumulation
    sizes = [m for m in range(1, b + 1) if B % m == 0]
    modes = ("transformers",) if own.mode == "transformers" else \
        tuple(m for m in MODES if m != "transformers" or spec.kind != "cuda")
    offloads = (False,) if trainer.lr_scheduler is not None else (False, True)
    return [Candidate(m, B // m, mode, off) for m in sizes for mode in modes for off in offloads
            if Candidate(m, B // m, mode, off) != own]


def _needs_no_less(c: Candidate, failed: Candidate) -> bool:
    """``c`` holds at least what ``failed`` held (Note 2)."""
    return (c.mode == failed.mode or c.mode == "keep") and \
        c.micro_batch_size >= failed.micro_batch_size and \
        c.offload_optimizer <= failed.offload_optimizer


def _modes(c: Candidate, blocks: list[str]) -> tuple[str, ...]:
    n = len(blocks)
    if c.mode == "every:2":       # checkpoint Note 2: the K-th, 2K-th, ... blocks
        return tuple("recompute" if i % 2 == 1 else "keep" for i in range(n))
    one = {"keep": "keep", "selective": "selective", "transformers": "recompute",
           "offload": "offload"}[c.mode]
    return (one,) * n


def _time_model(one: Estimate, args, b: int):
    """Seconds of a candidate's optimizer step, from a one-micro-batch trace (Note 2). A
    trainer that checkpoints already is timed as if it kept its blocks: every candidate then
    recomputes the same, so only the ranking matters."""
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    model = TimeModel(one, one.device, precision, b, MemoryModel(one, b))
    total = args.per_device_train_batch_size * args.gradient_accumulation_steps

    def seconds(c: Candidate) -> float:
        return model.step_s(c.micro_batch_size, total, _modes(c, one.blocks), c.offload_optimizer)
    return seconds


@contextlib.contextmanager
def _configured(trainer, c: Candidate):
    """The trainer with ``c``'s TrainingArguments, for one trace; restored after."""
    saved_args, saved_b = trainer.args, trainer._train_batch_size
    trainer.args = _set_args(copy.copy(saved_args), c)
    trainer._train_batch_size = trainer.args.train_batch_size
    try:
        yield trainer
    finally:
        trainer.args, trainer._train_batch_size = saved_args, saved_b


def _set_args(args, c: Candidate):
    args.per_device_train_batch_size = c.micro_batch_size
    args.gradient_accumulation_steps = c.accumulation
    if c.mode == "transformers" and not args.activation_checkpointing:
        args.activation_checkpointing = args.gradient_checkpointing = True
        args.activation_checkpointing_kwargs = {"use_reentrant": False}
    return args


def _trace(trainer, c: Candidate, device) -> Estimate:
    with _configured(trainer, c):
        return estimate(trainer, device, **c.knobs)


def _apply(trainer, c: Candidate, est: Estimate, plain: Estimate, ratio: float,
           budget_bytes: int, traced: int, verbose: bool) -> Changes:
    """Note 3."""
    args, undo, changed = trainer.args, [], {}
    before = {k: copy.copy(getattr(args, k)) for k in _ARG_NAMES}
    _set_args(args, c)
    for k in _ARG_NAMES:
        if getattr(args, k) != before[k]:
            changed[k] = (before[k], getattr(args, k))
    saved_b = trainer._train_batch_size
    trainer._train_batch_size = args.train_batch_size

    def restore_args():
        for k, v in before.items():
            setattr(args, k, v)
        trainer._train_batch_size = saved_b
    undo.append(restore_args)
    blocks = {}
    try:
        knobs = c.knobs
        if "checkpoint" in knobs:
            handle = Checkpoint(Checkpoint.Config(knobs["checkpoint"])).apply(trainer.model)
            undo.append(handle.remove)
            blocks.update(handle.modes)
        if "offload" in knobs:
            handle = Offload(Offload.Config(knobs["offload"])).apply(trainer.model)
            undo.append(handle.remove)
            blocks.update(handle.modes)
        if c.offload_optimizer:
            old = trainer.optimizer
            trainer.optimizer = OptimizerOffload(OptimizerOffload.Config()).wrap(
                trainer_optimizer(trainer))
            undo.append(lambda: setattr(trainer, "optimizer", old))
    except BaseException:
        while undo:
            undo.pop()()
        raise
    out = Changes(candidate=c, args=changed, blocks=blocks, optimizer_offloaded=c.offload_optimizer,
                  predicted_peak_bytes=est.peak_bytes, predicted_device_bytes=est.device_bytes,
                  plain_device_bytes=plain.device_bytes, predicted_step_time_ratio=ratio,
                  budget_bytes=budget_bytes, traced=traced, estimate=est, _undo=undo)
    if verbose:
        print(out)
    return out


_ARG_NAMES = ("per_device_train_batch_size", "gradient_accumulation_steps",
              "activation_checkpointing", "gradient_checkpointing",
              "activation_checkpointing_kwargs")
