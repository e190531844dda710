"""The per-block plan of ``trainer.train()``: memfit's planner models and search over the
Trainer's own step (``fit(trainer, budget)`` applies the result, ``_hf_fit``).

Note 1 (the models: the planner's, from one micro-batch). ``memfit.plan`` reads its memory
and time models off a plain trace of the whole effective batch as one micro-batch and a second
at half of it (``api.plan``, ``planner.memory_model``), and models accumulation
and micro-batches from them (memory_model, time_model). Here the same two
traces are of the Trainer's real step (``_hf_step.TrainerStep``, the user's precision,
clipping, optimizer and scheduler) with ``gradient_accumulation_steps=1`` and
``per_device_train_batch_size`` b and b // 2: a trace of one micro-batch. The effective batch
B = b x accumulation stays the user's; the models predict any micro-batch m of it (the
inputs of all B samples alive, as ``get_batch_samples`` keeps them, plus all gradients alive
from the second micro-batch on).

Note 2 (the search). The space is the planner's (``planner.search``): one mode per block
(keep / recompute / selective / offload, a MILP), memfit's optimizer-state offload, and the
micro-batch m: here a divisor of B no larger than the user's b (the Trainer needs
``per_device_train_batch_size x gradient_accumulation_steps`` = B, and a larger micro-batch than
the user chose is not offered). ``search`` runs once per m with m fixed and the fastest
predicted choice over all m wins. A trainer that checkpoints with transformers' own
activation checkpointing keeps it: its blocks are then fixed to "keep" for memfit's hooks
(they already recompute), and only m and the optimizer's placement are searched. The models
are keyed as the planner's, ``(precision, None)``: one pair per precision fit may use (the
arguments' own unless ``fit(precision=...)`` allows another, ``_hf_precision``).

Note 3 (verification, and the floor). As in ``api.plan``: the choice is re-traced
with the Trainer's real step configured as chosen (``trace``: its TrainingArguments on a copy
of ``trainer.args``, memfit's knobs on the fake model), and that trace is the answer, on CPU
exact. Over the budget, the search runs again with the cap lowered by what was missing: the
verify loop every planner runs (``planner.verify``). When nothing is found, the floor is traced
(``planner.verify.least_traced``): the planner's least-memory
candidates (``planner.search.floor_candidates``) at the smallest and the largest allowed m,
each re-traced; the least is the floor, applied if it fits, else ``BudgetTooSmall`` names it.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

from memfit.api._choice import knob_values
from memfit.api.estimate import Estimate
from memfit.integrations._hf_estimate import estimate
from memfit.integrations._hf_precision import at_precision, set_precision, user_precision
from memfit.planner.memory_model import MemoryModel
from memfit.planner.choice import Choice, Constraints
from memfit.planner.search import floor_candidates, search
from memfit.planner.time_model import TimeModel
from memfit.planner.verify import Margins, least_traced, verify_loop

__all__ = ["Candidate", "TrainerModels", "trace", "configured", "set_args"]


@dataclass(frozen=True)
class Candidate:
    """One configuration of the Trainer's step: TrainingArguments (micro-batch, accumulation,
    precision) and memfit's per-block modes and optimizer placement."""

    micro_batch_size: int                 # per_device_train_batch_size
    accumulation: int                     # gradient_accumulation_steps
    blocks: tuple[str, ...]               # the model's blocks, in execution order
    modes: tuple[str, ...]                # one memfit mode per block (memory_model.MODES)
    offload_optimizer: bool
    precision: str = "fp32"               # "fp32" | "bf16" | "fp16" (TrainingArguments)
    checkpointing: bool = False           # transformers' own, the user's setting (kept)

    @classmethod
    def of(cls, choice: Choice, total: int, blocks, checkpointing: bool) -> "Candidate":
        m = choice.micro_batch_size
        return cls(m, total // m, tuple(blocks), tuple(choice.modes), choice.offload_optimizer,
                   choice.precision, checkpointing)

    @property
    def choice(self) -> Choice:
        return Choice(self.precision, self.micro_batch_size, self.modes, self.offload_optimizer,
                      0, 0, 0.0)

    @property
    def knobs(self) -> dict:
        """What memfit adds through the model and the optimizer (the rest is TrainingArguments):
        ``checkpoint`` / ``offload`` policies and ``offload_optimizer``, as ``memfit.plan``'s."""
        v = knob_values(self.choice, list(self.blocks))
        return {k: v[k] for k in ("checkpoint", "offload", "offload_optimizer")}

    def describe(self) -> str:
        """"micro-batch 2 x 2, 5 of 12 blocks recompute, 1 of 12 blocks offload"."""
        out = [f"micro-batch {self.micro_batch_size} x {self.accumulation}"]
        if self.precision != "fp32":
            out.append(self.precision)
        if self.checkpointing:
            out.append("activation checkpointing (transformers')")
        n = len(self.modes)
        counts = {m: self.modes.count(m) for m in set(self.modes) if m != "keep"}
        out += [f"{c} of {n} blocks {m} (memfit hooks)" for m, c in sorted(counts.items())]
        if not counts and not self.checkpointing:
            out.append("every block kept")
        if self.offload_optimizer:
            out.append("optimizer state on host")
        return ", ".join(out)


@contextlib.contextmanager
def configured(trainer, c: Candidate):
    """The trainer with ``c``'s TrainingArguments (and, at another precision, an accelerator
    built at it: ``_hf_precision``), for one trace; restored after."""
    saved_args, saved_b = trainer.args, trainer._train_batch_size
    try:
        with at_precision(trainer, c.precision):
            trainer.args = set_args(copy.copy(trainer.args), c)
            trainer._train_batch_size = trainer.args.train_batch_size
            yield trainer
    finally:
        trainer.args, trainer._train_batch_size = saved_args, saved_b


def set_args(args, c: Candidate):
    """``c``'s TrainingArguments on ``args`` (in place)."""
    args.per_device_train_batch_size = c.micro_batch_size
    args.gradient_accumulation_steps = c.accumulation
    if c.precision != user_precision(args):
        set_precision(args, c.precision)
    return args


def trace(trainer, c: Candidate, device) -> Estimate:
    """The Trainer's real step configured as ``c``, traced (Note 3)."""
    with configured(trainer, c):
        return estimate(trainer, device, **c.knobs)


class TrainerModels:
    """The planner's memory and time models of the Trainer's step (Note 1), and the search
    over them (Notes 2 and 3)."""

    def __init__(self, trainer, device, spec, precisions: list[str],
                 one: Estimate | None = None):
        """``precisions``: those searched (``_hf_precision.precisions_for``); ``one``: the trace
        of one micro-batch of b at the user's precision, where the caller has it (the plain
        step of a trainer that does not accumulate)."""
        args = trainer.args
        self.trainer, self.device, self.spec = trainer, device, spec
        self.precision = user_precision(args)
        self.b = args.per_device_train_batch_size
        self.total = self.b * args.gradient_accumulation_steps
        self.checkpointing = bool(args.activation_checkpointing)
        self.sizes = [m for m in range(1, self.b + 1) if self.total % m == 0]
        self.blocks: list[str] = []
        self.models: dict[tuple, tuple[MemoryModel, TimeModel]] = {}
        self.traced = 0
        for p in precisions:
            full = one if p == self.precision and one is not None else self._plain(p, self.b)
            half = self._plain(p, self.b // 2) if self.b > 1 else None
            memory = MemoryModel(full, self.b, half)
            self.blocks = list(memory.blocks)
            self.models[(p, None)] = memory, TimeModel(full, spec, p, self.b, memory, half)
        if (self.precision, None) in self.models:
            self.baseline = self.models[(self.precision, None)][1]
        else:                  # the user's own step times the ratio (api.plan)
            full = one if one is not None else self._plain(self.precision, self.b)
            memory = MemoryModel(full, self.b)
            self.baseline = TimeModel(full, spec, self.precision, self.b, memory)

    def _plain(self, precision: str, m: int) -> Estimate:
        """The Trainer's step on one micro-batch of ``m``, as configured otherwise (Note 1)."""
        c = Candidate(m, 1, (), (), False, precision, self.checkpointing)
        self.traced += 1
        with configured(self.trainer, c):
            return estimate(self.trainer, self.device)

    def candidate(self, choice: Choice) -> Candidate:
        return Candidate.of(choice, self.total, self.blocks, self.checkpointing)

    def step_s(self, c: Candidate) -> float:
        """Predicted seconds of one optimizer step of ``c`` (time model)."""
        _, time = self.models[(c.precision, None)]
        return time.step_s(c.micro_batch_size, self.total, c.modes, c.offload_optimizer)

    def plain_s(self) -> float:
        """Predicted seconds of the trainer's step as configured (the ratio's baseline)."""
        n = len(self.blocks)
        return self.baseline.step_s(self.b, self.total, ("keep",) * n, False)

    def constraints(self, m: int | None, offload_optimizer: bool | None) -> Constraints:
        modes = {n: ("keep",) for n in self.blocks} if self.checkpointing else None
        return Constraints(m, modes, offload_optimizer)

    def search(self, budget_bytes: int, sizes, offload_optimizer, margins) -> Candidate | None:
        """The fastest predicted candidate over ``sizes`` (Note 2), or None."""
        best = None
        for m in sizes:
            found = search(self.models, self.total, budget_bytes,
                           self.constraints(m, offload_optimizer), margins)
            if found is not None and (best is None or found.step_s < best.step_s):
                best = found
        return None if best is None else self.candidate(best)

    def floor(self, sizes, offload_optimizer, say) -> tuple[Candidate, Estimate]:
        """The least traced of the planner's least-memory candidates (Note 3), as every
        planner finds it (``planner.verify.least_traced``)."""
        proposed = []
        for m in sorted({min(sizes), max(sizes)}):
            proposed += floor_candidates(self.models, self.total,
                                         self.constraints(m, offload_optimizer))

        def traced(ch: Choice):
            self.traced += 1
            est = trace(self.trainer, self.candidate(ch), self.device)
            return est.device_bytes, est

        _, ch, est = least_traced(proposed, predicted=lambda ch: ch.device_bytes,
                                  ident=self.candidate, trace=traced, say=say,
                                  describe=lambda ch: self.candidate(ch).describe())
        return self.candidate(ch), est

    def plan(self, budget_bytes: int, sizes, offload_optimizer, say):
        """Search and verify (Note 3; ``planner.verify.verify_loop``, as every planner):
        ``(candidate, its trace, attempts)`` or None when nothing the models propose re-traces
        under the budget."""
        def verify(c: Candidate):
            say(f"verifying: re-tracing {c.describe()}")
            self.traced += 1
            est = trace(self.trainer, c, self.device)
            return est, est.device_bytes

        margins = Margins(budget_bytes)
        for key in self.models:
            margins.start(key)
        found = verify_loop(
            lambda margins: self.search(budget_bytes, sizes, offload_optimizer, margins.bytes),
            verify, lambda c: (c.precision, None), margins)
        return None if found is None else (found.candidate, found.trace, found.attempt)
