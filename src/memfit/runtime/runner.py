"""``Runner``: one effective batch per ``step``, with the techniques of a plan applied.

Note 1 (order within an effective batch). zero_grad(set_to_none) -> for each micro-batch: forward
under autocast, loss weighted by its share of the effective batch's count (a mean over the effective
batch, as one large batch's), backward (scaled under fp16), gradients reduced only on the last
micro-batch -> once: unscale, clip, optimizer step (skipped by the scaler on inf/NaN), scale update,
LR scheduler. With one micro-batch and no loss scaling this is exactly
``memfit.step.canonical_step``, op for op. The knob ``zero_grad`` moves the zero_grad after the
first micro-batch's forward ("after-forward") or zeroes the buffers in place ("keep-buffers"), as
``memfit.step.canonical_step`` does.

Note 2 (no host syncs inside). ``run`` returns tensors and never reads a value back, so the
same code runs on fake tensors when ``estimate`` traces it; ``step`` does the bookkeeping
(``.item()``) afterwards.

Note 3 (out of memory). The optimizer step is checked against the budget before it runs
(``applied.budget_bytes``), and with ``replan`` an effective batch that runs out of memory is
restored (RNG, loss scale; gradients set to None), re-planned and run again (``oom_guard``).

Note 4 (plan and applied). ``runner.plan`` is the plan as searched and is never changed (a ``Plan``
is frozen); ``runner.applied`` (``Applied``) is what building the Runner did: each block's mode as
installed, whether the optimizer was rebuilt, the budget held, notes.

Note 5 (the user's step). With ``user_step`` (``memfit.step.UserStep``) ``run`` calls the
user's ``fn(model, batch, optimizer)`` instead of Note 1's loop, on the batch as given: its
precision, accumulation, clipping and zero_grad are the user's; the plan reaches it only through
the model's block hooks and the optimizer. ``step`` then steps the scheduler (if any) and
returns what ``fn`` returned as a float (NaN for None). There is no OOM guard: a re-run could not
restore what ``fn`` keeps between calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from memfit.measure._compile_aware import has_compiled
from memfit.planner import Plan
from memfit.runtime.applied import Applied
from memfit.runtime.batch_shape import BatchShapes
from memfit.runtime.oom_guard import OomGuard, check_optimizer_step, committing
from memfit.step import UserStep, compute_loss, prepare_batch, zero_grad
from memfit.techniques.accumulation import Accumulation
from memfit.techniques.precision import Precision
from memfit.trace._counted_compile import activation_budget

__all__ = ["Runner", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """What the last ``Runner.step`` did."""

    loss: float                 # the effective batch's loss, count-weighted over micro-batches
    skipped: bool               # the optimizer step was skipped (inf/NaN gradients under fp16)
    loss_scale: float | None    # the scale used for this batch (fp16), else None
    micro_batches: int
    items: int                  # what the loss averaged over, on all ranks (tokens or samples)
    grad_norm: float | None     # global gradient norm before clipping (when clipping)


def _world(model: nn.Module) -> int:
    distributed = isinstance(model, nn.parallel.DistributedDataParallel) or \
        hasattr(model, "set_requires_gradient_sync")
    return dist.get_world_size() if distributed and dist.is_initialized() else 1


class Runner:
    """Trains ``model`` with ``optimizer`` one effective batch at a time (see the Notes)."""

    def __init__(self, model: nn.Module, optimizer, *, plan: Plan, precision: Precision,
                 accumulation: Accumulation, loss_fn: Callable | None = None, scaler=None,
                 scheduler=None, device_type: str = "cpu", handles=(), contexts=(),
                 replan: Callable[[int], "Runner"] | None = None,
                 applied: Applied | None = None, batch_shapes: BatchShapes | None = None,
                 user_step: UserStep | None = None,
                 on_phase: Callable[[str], None] | None = None):
        self.model = model
        self._compiled = has_compiled(model)     # its masks stay (memfit.step.prepare_batch)
        self.optimizer = optimizer
        self.plan = plan              # as searched, never changed (Note 4)
        self.applied = applied or Applied(blocks=plan.blocks, budget_bytes=plan.budget_bytes)
        self.precision = precision
        self.accumulation = accumulation
        self.loss_fn = loss_fn
        self.scaler = scaler
        self.scheduler = scheduler
        self.device_type = device_type
        self.last_step: StepInfo | None = None
        self.batch_shapes = batch_shapes    # the planned batch's shapes: a larger batch warns
        self.user_step = user_step          # the user's own step, run instead of Note 1's
        self.on_phase = on_phase    # run's default on_phase (the plan's allocator pools)
        self.handles = list(handles)      # the techniques' ``Change``s; ``close`` removes them
        # factories of context managers entered around each effective batch (e.g. DTR)
        self.contexts = list(contexts)
        # replan(excess_bytes) -> a new Runner over the same model, adopted after an OOM
        self.guard = None
        if replan is not None or _world(model) > 1:   # several ranks: one OOM stops them all
            self.guard = OomGuard(replan, distributed=_world(model) > 1)
            if self.guard.off_reason is not None:
                self.applied = self.applied.with_note(self.guard.off_reason)

    def close(self) -> None:
        """Remove the techniques applied to the model's modules (checkpoint and offload hooks)."""
        while self.handles:
            self.handles.pop().remove()

    def prepare(self, batch):
        """The batch as ``run`` takes it: an all-ones mask dropped, bf16-pure inputs cast (a
        user step takes the batch as given, Note 5)."""
        if self.user_step is not None:
            return batch
        return self.precision.prepare_batch(prepare_batch(batch, self._compiled))

    def step(self, batch) -> float:
        """Train on one effective batch; return its loss (count-weighted, global). With
        ``replan``, an out-of-memory error re-plans and reruns the batch (Note 3). A batch
        larger than the planned one warns, once per shape."""
        if self.batch_shapes is not None:
            self.batch_shapes.check(batch)
        if self.guard is not None:
            return self.guard.step(self, batch)
        return self.step_unguarded(batch)

    def step_unguarded(self, batch) -> float:
        """One try at ``step``: an out-of-memory error propagates as is."""
        batch = self.prepare(batch)
        if self.user_step is not None:
            return self._step_user(batch)
        counted = int(self.accumulation.count(self.model, batch))   # this rank, whole batch
        if self.accumulation.count_fn is None and counted == 0:
            raise ValueError("the batch has nothing to learn from: every label is -100 (or "
                             "there are no samples), so the loss would be 0/0; skip it")
        scale = self.scaler.get_scale() if self.scaler is not None else None
        with contextlib.ExitStack() as stack:
            for make in self.contexts:
                stack.enter_context(make())
            loss, items, grad_norm, n = self.run(batch)
        skipped = False
        if self.scaler is not None:
            skipped = self.scaler.get_scale() < scale      # update() lowers it after a skip
        if self.scheduler is not None and not skipped:
            self.scheduler.step()
        if items is None:     # one micro-batch on one rank: run did not count
            items = counted
        self.last_step = StepInfo(
            loss=float(loss), skipped=skipped, loss_scale=scale, micro_batches=n,
            items=int(items), grad_norm=None if grad_norm is None else float(grad_norm))
        return self.last_step.loss

    def _step_user(self, batch) -> float:
        """``step`` for a user step (Note 5)."""
        with contextlib.ExitStack() as stack:
            for make in self.contexts:
                stack.enter_context(make())
            loss, _, _, n = self.run(batch)
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if self.scheduler is not None:
            self.scheduler.step()
        self.last_step = StepInfo(
            loss=float("nan") if loss is None else float(loss), skipped=False, loss_scale=None,
            micro_batches=n, items=int(self.accumulation.count(self.model, batch)),
            grad_norm=None)
        return self.last_step.loss

    def run(self, batch, on_phase: Callable[[str], None] | None = None):
        """The effective batch, without host syncs (Note 2). Returns (loss, items or None,
        grad norm or None, number of micro-batches)."""
        mark = on_phase or self.on_phase or (lambda phase: None)
        model, opt, scaler = self.model, self.optimizer, self.scaler
        if self.user_step is not None:        # Note 5
            return self.user_step(model, batch, opt, mark), None, None, 1
        micro = self.accumulation.split(batch)
        world = _world(model)
        weights, total = self._weights(micro, world)
        style = self.plan.knobs.zero_grad
        zero_grad(opt, style, "start")
        loss_sum = None
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            with self.accumulation.sync(model, last):
                mark("forward")
                with self.precision.autocast(self.device_type), \
                        activation_budget(self.plan.knobs.activation_memory_budget):
                    loss = compute_loss(model, mb, self.loss_fn)     # (a compiled model
                    # compiles at its first forward, where the partitioner reads the budget)
                if weights is not None:
                    loss = loss * weights[i]
                if i == 0:
                    zero_grad(opt, style, "after-forward")
                mark("backward")
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss = loss.detach()
            if weights is not None:        # a micro-batch with nothing to count reports 0, not NaN
                loss = torch.where(weights[i] == 0, torch.zeros_like(loss), loss)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        mark("optimizer")
        grad_norm = self.optimizer_phase()
        if world > 1:             # each rank holds world x its share of the global mean
            loss_sum = loss_sum.clone()
            dist.all_reduce(loss_sum)
            loss_sum = loss_sum / world
        return loss_sum, total, grad_norm, len(micro)

    def optimizer_phase(self):
        """The effective batch's optimizer phase, once its gradients are made: unscale, clip,
        the optimizer step (under fp16 the scaler's), the scale update. Returns the gradient
        norm or None. ``estimate(optimizer_only=True)`` traces this alone."""
        check_optimizer_step(self.plan.predicted_optimizer_step_bytes,   # parameters untouched
                             self.applied.budget_bytes, self.device_type)   # so far
        grad_norm = self._unscale_and_clip()
        with committing():
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        return grad_norm

    def _weights(self, micro: list, world: int):
        """Each micro-batch's loss weight ``count_i * world / total``: the sum of the weighted
        means is the mean over the effective batch (over every rank's, under DDP/FSDP)."""
        if len(micro) == 1 and world == 1:
            return None, None
        counts = [torch.as_tensor(self.accumulation.count(self.model, mb)) for mb in micro]
        total = torch.stack(counts).sum()
        if world > 1:
            total = total.to(self._device())
            dist.all_reduce(total)
        return [c.to(total.device) * world / total for c in counts], total

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device(self.device_type)

    def _unscale_and_clip(self):
        max_norm = self.plan.knobs.max_grad_norm
        if max_norm is None:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)   # clip true gradients, not scaled ones
        if hasattr(self.optimizer, "clip_grad_norm_"):   # it knows where its gradients are
            return self.optimizer.clip_grad_norm_(max_norm)   # (offload_gradients: the host)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if hasattr(self.optimizer, "masters"):     # bf16-pure: the model's bf16 grads
            params = self.optimizer.params
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
