"""``Job``: the training job memfit is asked about, validated once, handed to every front.

A Job is what ``estimate``, ``plan`` and ``fit`` used to take as six to eight loose
arguments (``model, batch, optimizer, loss_fn, count_fn, step, scheduler, max_seq_len``), in
three different positional orders. Made once, it is checked once here, at construction, and
each front then takes only what it adds: ``estimate(job, device=, **knobs)``,
``plan(job, budget=, device=, **fixed)``, ``fit(job, budget=, device=, **knobs)``.

Note 1 (what is checked where). Construction checks each field alone and the fields against
each other: the model is an ``nn.Module`` (a zoo name gets the call that builds one), the batch
holds tensors with a batch dimension (and is a mapping of model inputs unless ``loss_fn`` or
``step`` says how to use it), the optimizer is a known name, a factory or an instance over the
model's own parameters, ``step`` can be called as ``fn(model, batch, optimizer)``, and the
contradictions (``step`` with ``loss_fn``, ``step`` or a non-mapping batch with
``max_seq_len``) are refused. Every message names the field and the fix. Whether the batch
fits the model's forward (its keys, its length, its token ids) needs the model's inputs and
config: each front checks it before any trace (``memfit.api._validate.check_batch``), and the
knobs a user step fixes are checked against the knobs the front is given.

This module sits low (it imports only leaf modules: optimizers, step, the zoo's model check and
the batch size of ``techniques.accumulation``): every layer may be handed a Job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from memfit.optimizers import OptimizerRecipe
from memfit.step import UserStep
from memfit.techniques.accumulation import batch_size_of
from memfit.zoo._model_arg import check_model

__all__ = ["Job"]


@dataclass(frozen=True, eq=False, repr=False)
class Job:
    """One training job: the model, an example batch and how one step trains on it.

    ``memfit.Job(model, batch, optimizer="adamw", loss_fn=None, count_fn=None, step=None,
    scheduler=None, max_seq_len=None)``; checked at construction (Note 1), never changed after
    (``job.replace(...)`` makes another, checked again). Two Jobs are equal only when they are
    the same object (a model and tensors have no value equality).
    """

    model: nn.Module
    """The model to train: any ``nn.Module``, real or on the ``meta`` device (not touched by
    ``estimate`` and ``plan``)."""
    batch: object
    """An example effective batch (the longest, with dynamic padding; or see ``max_seq_len``):
    a mapping is called as ``model(**batch)`` and the loss is ``out.loss``; anything else needs
    ``loss_fn`` or ``step``. Tensors whose first dimension is the batch size are split into
    micro-batches."""
    optimizer: object = "adamw"
    """A name ("adamw", "sgd", ... ``memfit.optimizers.OPTIMIZERS``), an optimizer instance over
    the model's parameters (what ``fit`` trains with), or a factory ``params -> Optimizer``."""
    loss_fn: Callable | None = None
    """``loss_fn(model, batch) -> loss`` (a one-element tensor), for a batch the model cannot
    take as ``model(**batch)``; None: ``model(**batch).loss``."""
    count_fn: Callable | None = None
    """``count_fn(batch) -> int``: what the loss averages over (tokens or samples), which
    normalises the loss across micro-batches; None: what the model's loss counts."""
    step: Callable | None = None
    """The user's own training step ``fn(model, batch, optimizer)``, traced and run as written
    (zero_grad, clipping, a GradScaler inside it); None: memfit's canonical step."""
    scheduler: object = None
    """An LR scheduler stepped once per effective batch: a factory ``optimizer -> scheduler``
    (what ``estimate`` and ``plan`` need: they build it on a fake optimizer), or, for ``fit``
    only, an instance over the optimizer given."""
    max_seq_len: int | None = None
    """Tokens: plan for ``batch`` extended to this length (dynamic padding: the longest batch
    without making it; ``memfit.runtime.batch_shape.extend_batch``); None: the batch as
    given."""

    def __post_init__(self):
        check_model(self.model, "Job.model")
        self._check_functions()
        self._check_batch()
        try:
            recipe = OptimizerRecipe(self.optimizer)
            recipe.check_params([p for p in self.model.parameters() if p.requires_grad])
        except ValueError as e:
            raise ValueError(f"Job.optimizer: {e}") from None

    def _check_functions(self) -> None:
        for name, shape in (("loss_fn", "loss_fn(model, batch) -> loss"),
                            ("count_fn", "count_fn(batch) -> int")):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"Job.{name} must be a function {shape} or None, got "
                                f"{type(value).__name__}")
        s = self.scheduler
        if s is not None and not callable(s) and not hasattr(s, "step"):
            raise TypeError("Job.scheduler must be a factory optimizer -> LR scheduler (e.g. "
                            "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)) or a "
                            f"scheduler, got {type(s).__name__}")
        if self.step is not None:
            try:
                UserStep(self.step)
            except ValueError as e:
                raise ValueError(f"Job.step: {e}") from None
            if self.loss_fn is not None:
                raise ValueError("Job.loss_fn with Job.step: the step computes its own loss; "
                                 "leave loss_fn out")
            if self.max_seq_len is not None:
                raise ValueError("Job.max_seq_len with Job.step: the step is traced on the "
                                 "batch as given; pass the longest batch itself")
        n = self.max_seq_len
        if n is not None and (type(n) is not int or n < 1):
            raise ValueError(f"Job.max_seq_len must be an int >= 1 (tokens) or None, got {n!r}")

    def _check_batch(self) -> None:
        try:
            batch_size_of(self.batch)
        except ValueError as e:
            raise ValueError(f"Job.batch: {e}") from None
        if isinstance(self.batch, Mapping):
            return
        kind = type(self.batch).__name__
        if self.max_seq_len is not None:
            raise ValueError(f"Job.max_seq_len needs a mapping batch (input_ids, labels, ...) "
                             f"to extend; Job.batch is a {kind}: pass the longest batch itself")
        if self.loss_fn is None and self.step is None:
            raise ValueError(f"Job.batch is a {kind}, not a mapping of model inputs "
                             "(model(**batch)): pass loss_fn=fn(model, batch) -> loss, or "
                             "step=fn(model, batch, optimizer)")

    def replace(self, **changes) -> "Job":
        """A new Job with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def arguments(self) -> dict:
        """The job as the keyword arguments today's functions take (``memfit.api.estimate.
        estimate``, ``.plan.plan``, ``.fit.fit``): model, batch, optimizer, loss_fn always;
        count_fn, step, scheduler where set (``max_seq_len`` is ``fit``'s alone: not here)."""
        out = dict(model=self.model, batch=self.batch, optimizer=self.optimizer,
                   loss_fn=self.loss_fn)
        out.update({n: getattr(self, n) for n in ("count_fn", "step", "scheduler")
                    if getattr(self, n) is not None})
        return out

    def __repr__(self) -> str:
        opt = self.optimizer if isinstance(self.optimizer, str) else type(self.optimizer).__name__
        parts = [type(self.model).__name__, f"batch={_shapes(self.batch)}", f"optimizer={opt!r}"]
        parts += [f"{n}={_name(getattr(self, n))}" for n in
                  ("loss_fn", "count_fn", "step", "scheduler") if getattr(self, n) is not None]
        if self.max_seq_len is not None:
            parts.append(f"max_seq_len={self.max_seq_len}")
        return f"Job({', '.join(parts)})"


def _shapes(batch) -> str:
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k}: {tuple(v.shape)}" if isinstance(v, torch.Tensor) else
                               f"{k}: {type(v).__name__}" for k, v in batch.items()) + "}"
    if isinstance(batch, (tuple, list)):
        return type(batch).__name__ + "(" + ", ".join(
            str(tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__
            for v in batch) + ")"
    return type(batch).__name__


def _name(fn) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)
