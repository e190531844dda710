"""The OOM guard: an effective batch that runs out of memory is re-planned and run again.

Note 1 (what is restored). ``Runner.step`` takes a ``Snapshot`` before the effective batch: the CPU
generator state, every CUDA generator's state (when CUDA is initialised) and the GradScaler's
``state_dict``. After an out-of-memory error it puts them back and sets every gradient to None, as
the batch's own ``zero_grad(set_to_none=True)`` would. Parameters and optimizer state need no copy:
nothing writes them before the optimizer step (Note 3), and ``memfit.OutOfMemory`` undoes the op
that raised it (its outputs dropped, the inputs it wrote restored). The scaler's per-optimizer stage
is cleared too (an OOM between ``unscale_`` and ``update`` would leave it "unscaled" and the rerun's
``unscale_`` would refuse). The RNG restore is what makes the rerun draw the dropout masks an
uninterrupted run of the new plan draws.

Note 2 (re-planning). Outside the ``except`` block, so that the failed attempt's graph and
activations are already freed (the traceback held them), the guard empties the CUDA cache,
``close()``s the runner (its techniques come off the modules: the planner traces a copy of the
model, which must not carry them), calls ``replan(excess_bytes)`` and adopts the new runner's
model, optimizer, plan, applied record, precision, accumulation, handles and contexts. It keeps
the old scaler (the loss scale and its growth counter carry over; a new plan without loss
scaling drops it) and the old scheduler. The excess is ``live + requested - budget`` of a
``memfit.OutOfMemory``; a CUDA ``torch.OutOfMemoryError`` carries no numbers, so it is 0 and
the re-planner tightens by its own margin. At most ``max_retries`` re-plans per effective
batch; then the state is restored and the error re-raised with the plans tried. Inside
``memfit.track`` the failed attempt's activations are freed too: track's pack hook saves a
detached alias, so no saved output holds its own ``grad_fn`` from C++ (a cycle the gc cannot
see).

Note 3 (the optimizer step is a point of no return). Before the step ``check_optimizer_step``
compares the live device bytes plus ``plan.predicted_optimizer_step_bytes`` with
``runner.applied.budget_bytes`` and raises ``memfit.OutOfMemory`` (op ``optimizer.step``) while the
parameters are untouched. An OOM raised *inside* the step (``committing``) may leave them
half-updated, so it is marked and the guard re-raises it without a retry. Live bytes are
``torch.cuda.memory_allocated()`` on CUDA; on the CPU those of the innermost running
``memfit.track`` (device bytes, memfit's host pool excluded); with neither the check is skipped. It
reads host-side counters only, so ``Runner.run`` stays free of host syncs (it returns tensors and
never reads a device value); a traced plan has no budget and skips it.

Note 4 (distributed). Under DDP/FSDP with more than one rank the ranks must agree on one new plan:
only a ``replan`` marked ``collective`` (``memfit.fit(..., gpus=, sharding=)``'s, which plans on
rank 0, in a child process, and broadcasts the plan to all) re-plans, at the optimizer-step check
(Note 6). Any other ``replan`` (one process's planner, e.g. ``memfit.fit`` on a model the user
wrapped in DDP) is not used: ``runner.applied.notes`` says so when the runner is built, and an
out-of-memory error stops every rank with a note (Note 7). The Runner arms the guard under several
ranks even without a ``replan``, for Note 7.

Note 5 (a re-plan that fails). When ``replan`` raises (``BudgetTooSmall``: nothing fits what is left
of the budget; or any other error while planning or building), the runner is left as it was before
the batch: its techniques are put back on the modules (each handle's ``reapply()``, same blocks,
same modes), and its plan, applied record, optimizer, scaler and scheduler were never replaced;
parameters, optimizer state, RNG and loss scale are restored by Note 1 and gradients are None, as
the batch's own ``zero_grad(set_to_none=True)`` left them (keeping the old ones would hold a
gradient-sized copy through every batch). Then one error stops training: the batch's out-of-memory
error, rebuilt with its numbers (the original held the failed attempt's frames), with a note that
says re-planning failed and why, raised ``from`` the re-plan's error. Nothing is lost: the next
``step`` runs the old plan.

Note 6 (ranks agree before the optimizer step). Under more than one rank the check of Note 3
is collective (``oom_ranks.agree``): one ``all_reduce`` gathers each rank's excess, live bytes,
step bytes and budget, and if any rank would cross its budget every rank raises the same
``memfit.OutOfMemory`` (the worst rank's numbers, a note naming it), marked agreed, with the
parameters unchanged on every rank. The optimizer step of FSDP2 and DDP runs no collective,
so without this one rank would stop and the others would step. With a collective ``replan``
every rank then re-plans as one (Note 2, the excess the worst rank's, the same on each: rank 0
plans and broadcasts, so every rank adopts the same plan), restores (Note 1) and retries;
FSDP2's modules are resharded first (a failed attempt can leave a block's parameters
unsharded). A re-plan that fails raises Note 5's error, the same on every rank (the numbers
are agreed, ``BudgetTooSmall`` is decided once). Without a collective ``replan`` every rank
raises the agreed error as is; the group stays usable. Every rank must run the check or
none (its ``all_reduce`` pairs with the others'): it runs where the plan has step bytes and
the runner a budget, the same on every rank under ``memfit.fit``.

Note 7 (an out-of-memory error inside the step on one rank). Raised in a forward or backward (or
inside the optimizer step, Note 3) it is this rank's alone, while the others wait in a collective:
there is no agreement possible mid-step. The guard restores (Note 1), then ``oom_ranks.stop_here``
publishes the error on the job's store and shuts this rank's connections to the others, and the
error is re-raised with a note; on every other rank the pending collective then fails, and
``oom_ranks.stop_peer`` (on any ``RuntimeError`` out of the step) finds the published error and
raises it, rebuilt, with a note naming the rank that ran out and by how much, instead of gloo's
"Connection closed by peer" (``oom_ranks``: every wait bounded, the group's connections shut after a
stop, NCCL untested). Any other ``RuntimeError`` is raised as is, after at most
``oom_ranks.KEY_WAIT_S`` looking for a published error.

"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from memfit.errors import BudgetTooSmall, OutOfMemory
from memfit.measure.track import active_tracker
from memfit.runtime import oom_ranks
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.runtime.runner import Runner

__all__ = ["OomGuard", "Snapshot", "check_optimizer_step", "committing", "excess_bytes",
           "replan_shortfall", "REPLAN_MARGIN_BYTES",
           "MAX_RETRIES"]

MAX_RETRIES = 3          # re-plans of one effective batch before the guard gives up
_COMMITTED = "_memfit_in_optimizer_step"


@dataclass
class Snapshot:
    """What an effective batch may change before its optimizer step (Note 1)."""

    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    scaler_state: dict | None

    @classmethod
    def take(cls, runner: "Runner") -> "Snapshot":
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        scaler = runner.scaler.state_dict() if runner.scaler is not None else None
        return cls(torch.get_rng_state(), cuda, scaler)

    def restore(self, runner: "Runner") -> None:
        for m in runner.model.modules():       # FSDP2: the sharded parameters back in place
            if hasattr(m, "reshard") and hasattr(m, "set_reshard_after_forward"):
                m.reshard()
        for p in runner.model.parameters():
            p.grad = None
        for group in runner.optimizer.param_groups:     # e.g. bf16-pure's fp32 masters
            for p in group["params"]:
                p.grad = None
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if runner.scaler is not None and self.scaler_state is not None:
            runner.scaler.load_state_dict(self.scaler_state)
            runner.scaler._per_optimizer_states.clear()   # stage back to "ready" (Note 1)


def excess_bytes(e: torch.OutOfMemoryError) -> int:
    """Bytes over the budget the failed op asked for; 0 when unknown (CUDA's own error)."""
    if isinstance(e, OutOfMemory):
        return max(0, e.live_bytes + e.requested_bytes - e.budget_bytes)
    return 0


# what each re-plan takes off the budget beyond the measured excess (a CUDA OOM reports none,
# Note 2), at most 1/16 of the budget
REPLAN_MARGIN_BYTES = 64 * 2 ** 20


def replan_shortfall(missing: int, excess: int, budget: int, where: str = "") -> int:
    """The bytes a re-planner takes off ``budget`` after an out-of-memory error ``excess``
    bytes over it, ``missing`` taken before (Note 2); ``BudgetTooSmall`` when nothing is left.
    ``where``: words after "measured missing so far" (e.g. ", on the worst rank")."""
    missing += max(excess, 0) + min(REPLAN_MARGIN_BYTES, budget // 16)
    if missing >= budget:
        raise BudgetTooSmall(f"re-planning after running out of memory would leave nothing of "
                             f"the {format_bytes(budget)} budget ({format_bytes(missing)} "
                             f"measured missing so far{where}): raise the budget",
                             floor_bytes=budget + missing, budget_bytes=budget)
    return missing


def live_device_bytes(device_type: str) -> int | None:
    """Live bytes on the device (Note 3), or None where nothing counts them."""
    if device_type == "cuda":
        return torch.cuda.memory_allocated()
    tracker = active_tracker()
    if tracker is not None and tracker.device_type == device_type:
        return tracker.ledger.current_bytes
    return None


def check_optimizer_step(step_bytes: int | None, budget_bytes: int | None,
                         device_type: str) -> None:
    """Raise ``memfit.OutOfMemory`` before an optimizer step predicted to add ``step_bytes``
    would cross ``budget_bytes`` (Note 3); None for either skips the check. Under several
    ranks every rank raises the same error when one would cross it (Note 6)."""
    if budget_bytes is None or step_bytes is None:
        return
    live = live_device_bytes(device_type)
    excess = 0 if live is None else live + step_bytes - budget_bytes
    (worst, worst_live, step_bytes, budget_bytes), where = oom_ranks.agree(
        (excess, live or 0, step_bytes, budget_bytes), device_type)
    if worst <= 0:
        return
    e = OutOfMemory(requested_bytes=step_bytes, live_bytes=worst_live,
                    budget_bytes=budget_bytes, op="optimizer.step")
    if where is not None:         # the worst rank's numbers, on every rank
        e.add_note(oom_ranks.describe_worst(where, worst))
        oom_ranks.mark_agreed(e)
    raise e


@contextlib.contextmanager
def committing():
    """Around the optimizer step: an OOM from inside is marked as not retriable (Note 3)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        setattr(e, _COMMITTED, True)
        raise


def _describe(plan) -> str:
    knobs = ", ".join(f"{k}={v}" for k, v in plan.knobs.to_dict().items() if v is not None)
    return knobs or "the default knobs"


class OomGuard:
    """Reruns an effective batch that ran out of memory under a new plan (the Notes).

    ``replan`` None: no re-plan (several ranks without a budget): an out-of-memory error still
    stops every rank with one error (Note 7). A ``replan`` with ``collective = True`` plans
    once for every rank (Note 6); under several ranks any other is not used (Note 4)."""

    def __init__(self, replan: Callable[[int], "Runner"] | None, *, distributed: bool = False,
                 max_retries: int = MAX_RETRIES):
        if max_retries < 1:
            raise ValueError(f"OomGuard max_retries={max_retries} must be at least 1")
        self.replan = replan
        self.max_retries = max_retries
        self.distributed = distributed
        self.off_reason = None
        if distributed and replan is not None and not getattr(replan, "collective", False):
            self.off_reason = (
                "OOM guard off: with more than one rank the ranks must agree on a new plan, "
                "which only memfit.fit(..., gpus=, sharding=) plans for (one plan made on rank "
                "0 for all); an out-of-memory error stops every rank with one error instead "
                "(memfit.runtime.oom_guard Note 7)")

    def step(self, runner: "Runner", batch) -> float:
        saved = Snapshot.take(runner)
        if self.distributed:
            oom_ranks.publish_endpoints()         # Note 7
        tried: list[str] = []
        while True:
            try:
                return runner.step_unguarded(batch)
            except torch.OutOfMemoryError as e:
                excess, failed = excess_bytes(e), _Failure.of(e)
                tried.append(f"{_describe(runner.plan)} (over by {format_bytes(excess)})")
                committed = getattr(e, _COMMITTED, False)
                if committed:
                    e.add_note("memfit OOM guard: not retried, the error came from inside the "
                               "optimizer step, which may have updated some parameters")
                if self.distributed and not oom_ranks.is_agreed(e):    # Note 7
                    if not committed:
                        saved.restore(runner)
                    self._say_off(e)
                    oom_ranks.stop_here(e, failed)
                    raise
                if committed:
                    raise
                if self.replan is None or self.off_reason is not None:
                    saved.restore(runner)     # every rank raises this same error (Note 6)
                    self._say_off(e)
                    raise
                if len(tried) > self.max_retries:
                    saved.restore(runner)
                    e.add_note(self._gave_up(tried))
                    raise
            except RuntimeError as e:
                if not self.distributed:
                    raise
                stop = oom_ranks.stop_peer(e, _Failure.from_dict)     # Note 7
                if stop is None:
                    raise
                saved.restore(runner)
                raise stop from None
            # outside the except block: the failed attempt's tensors are gone (Note 2)
            saved.restore(runner)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._replan(runner, excess, failed)

    def _say_off(self, e: BaseException) -> None:
        if self.off_reason is not None:
            e.add_note(f"memfit: {self.off_reason}")

    def _replan(self, runner: "Runner", excess: int, failed: "_Failure") -> None:
        handles, new = list(runner.handles), None
        runner.close()
        try:
            new = self.replan(excess)
            _check_adoptable(runner, new)
        except BaseException as e:           # Note 5: back as it was, then one clear error
            if hasattr(new, "close"):
                new.close()                  # a Runner over another model: its hooks go
            runner.handles = [h.reapply() for h in handles]
            if not isinstance(e, Exception):     # KeyboardInterrupt, SystemExit: as they are
                raise
            raise failed.error(
                f"memfit OOM guard: the effective batch did not fit "
                f"({failed.numbers}) and re-planning failed: {type(e).__name__}: {e}\n"
                f"The runner is as before the batch: its plan ({_describe(runner.plan)}) and "
                "its techniques are back on the model; parameters, optimizer state, RNG and "
                "loss scale are unchanged and gradients are cleared. Raise the budget, or "
                "shorten or split the batch (memfit.fit(..., max_seq_len=) plans for the "
                "longest one).") from e
        adopt(runner, new)

    def _gave_up(self, tried: list[str]) -> str:
        lines = "\n".join(f"  {i + 1}. {t}" for i, t in enumerate(tried))
        return (f"memfit OOM guard: gave up after {self.max_retries} re-plans of this effective "
                f"batch. Plans tried:\n{lines}\nParameters, optimizer state, RNG and loss "
                "scale are as before the batch (gradients cleared); the runner keeps the last "
                "plan. Try a larger budget, a smaller batch or sequence length, or a lower "
                "precision.")


@dataclass(frozen=True)
class _Failure:
    """An out-of-memory error's kind, numbers and notes, without its traceback (Note 5); as a
    dict, what a rank publishes to the others (Note 7)."""

    fields: dict | None          # memfit.OutOfMemory's constructor arguments, else None
    message: str
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, e: torch.OutOfMemoryError) -> "_Failure":
        notes = tuple(getattr(e, "__notes__", ()))
        if isinstance(e, OutOfMemory):
            return cls(dict(requested_bytes=e.requested_bytes, live_bytes=e.live_bytes,
                            budget_bytes=e.budget_bytes, op=e.op, module=e.module), str(e),
                       notes)
        return cls(None, str(e), notes)

    def to_dict(self) -> dict:
        return {"fields": self.fields, "message": self.message, "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: dict) -> "_Failure":
        return cls(d["fields"], d["message"], tuple(d["notes"]))

    @property
    def numbers(self) -> str:
        f = self.fields
        if f is None:
            return "the device's own out-of-memory error, which gives no numbers"
        return (f"{f['op']} asked for {format_bytes(f['requested_bytes'])} with "
                f"{format_bytes(f['live_bytes'])} live, budget {format_bytes(f['budget_bytes'])}:"
                f" {format_bytes(f['live_bytes'] + f['requested_bytes'] - f['budget_bytes'])} "
                "over")

    def error(self, note: str) -> torch.OutOfMemoryError:
        e = OutOfMemory(**self.fields) if self.fields is not None else \
            torch.OutOfMemoryError(self.message)
        for n in self.notes + (note,):
            e.add_note(n)
        return e


def _check_adoptable(runner: "Runner", new) -> None:
    if not hasattr(new, "handles") or new.model is not runner.model:
        raise ValueError("replan must return a Runner over the same model (build it with "
                         "memfit.api._setup.build_runner on runner.model)")


def adopt(runner: "Runner", new: "Runner") -> None:
    """Move ``new``'s components into ``runner`` (Note 2)."""
    _check_adoptable(runner, new)
    rebuilt = new.optimizer is not runner.optimizer and len(runner.optimizer.state) > 0
    runner.optimizer = new.optimizer
    runner.plan = new.plan
    runner.applied = new.applied
    runner.precision = new.precision
    runner.accumulation = new.accumulation
    runner.handles, new.handles = list(new.handles), []
    runner.contexts = list(new.contexts)
    if new.scaler is None or runner.scaler is None:
        runner.scaler = new.scaler
    if rebuilt:
        runner.applied = runner.applied.with_note(
            "OOM guard: the re-plan rebuilt the optimizer, so its state (e.g. Adam's moments) "
            "starts afresh and a scheduler given as an instance drives the old one")
