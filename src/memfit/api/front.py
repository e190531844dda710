"""The public ``memfit.estimate``, ``memfit.plan`` and ``memfit.fit``: short calls on a ``Job``.

``estimate(job, device=None, **knobs)``, ``plan(job, budget=None, device=None, **fixed)`` and
``fit(job, budget=None, device=None, **knobs)`` hand the job's fields to the functions that do
the work (``memfit.api.estimate.estimate``, ``memfit.api.plan.plan``, ``memfit.api.fit.fit``,
which memfit's own modules call directly); any other keyword they take (``budget`` and
``allocator`` for estimate, ``floor`` for plan, ...) passes through. Knobs may be given flat
(``micro_batch_size=4``) or by concern (``batching=Batching(micro_batch_size=4)``), turned
flat here (``memfit.knobs.expand_groups``).

Note 1 (the old forms). ``estimate(model, batch, ...)``, ``plan(model, batch, ...)`` and
``fit(model, optimizer, batch, ...)`` keep working for one release: a first argument that is
not a ``Job`` is the old form, which warns once (``MemfitDeprecationWarning``, pointing at the
caller's line) with the new form and then calls through with its arguments unchanged.

Note 2 (``max_seq_len``). A Job's ``max_seq_len`` is the longest batch: ``fit`` takes it as it
always did, and ``estimate`` and ``plan`` trace the batch ``fit`` plans for (the all-ones mask
dropped, the sequence dims extended on ``meta``: ``memfit.runtime.batch_shape.extend_batch``).
"""

from __future__ import annotations

import inspect
import warnings

from memfit.api.estimate import Estimate
from memfit.api.estimate import estimate as _estimate
from memfit.api.fit import fit as _fit
from memfit.api.plan import plan as _plan
from memfit.errors import MemfitDeprecationWarning
from memfit.job import Job
from memfit.knobs import expand_groups
from memfit.planner import Plan
from memfit.runtime import Runner
from memfit.runtime.batch_shape import extend_batch
from memfit.step import prepare_batch

__all__ = ["estimate", "plan", "fit", "Job"]

_JOB_FIELDS = tuple(f for f in Job.__dataclass_fields__)

# the old form and the new one, in the warning's words (Note 1)
_NEW_FORM = {
    "estimate": "memfit.estimate(memfit.Job(model, batch, optimizer=..., loss_fn=...), "
                "device=..., **knobs)",
    "plan": "memfit.plan(memfit.Job(model, batch, optimizer=..., loss_fn=...), budget=..., "
            "device=..., **fixed)",
    "fit": "memfit.fit(memfit.Job(model, batch, optimizer=optimizer, loss_fn=...), "
           "budget=..., device=..., **knobs)",
}
_OLD_FORM = {"estimate": "memfit.estimate(model, batch, ...)",
             "plan": "memfit.plan(model, batch, ...)",
             "fit": "memfit.fit(model, optimizer, batch, ...)"}


def estimate(job: Job, *args, **kwargs) -> Estimate:
    """The memory of one steady-state training step of ``job``, without running it.

    ``estimate(job, device=None, **knobs)``: ``device`` a GPU name ("gtx-1080-ti"), "cpu" or
    a ``DeviceSpec`` (default: where the model is); knobs as ``memfit.Knobs`` takes them,
    and ``budget``, ``allocator``, ``cuda_version`` as ``memfit.api.estimate.estimate``
    documents them. The old form ``estimate(model, batch, optimizer, device, loss_fn, ...)``
    still works for one release, with a ``MemfitDeprecationWarning`` (Note 1).
    """
    if not isinstance(job, Job):
        _deprecated("estimate")
        return _estimate(job, *args, **kwargs)
    return _estimate_job(job, *args, **kwargs)


def plan(job: Job, *args, **kwargs) -> Plan:
    """The fastest configuration of ``job``'s step predicted (and re-traced) to fit ``budget``.

    ``plan(job, budget=None, device=None, **fixed)``: ``budget`` bytes or "11GiB" (default:
    the device's usable memory); ``fixed``: the knobs the caller fixes (the rest are
    searched), and ``floor``, ``allow_numerics_change``, ``batches``, ``allocator``,
    ``on_progress`` as ``memfit.api.plan.plan`` documents them. Raises
    ``memfit.BudgetTooSmall`` when nothing fits. The old form ``plan(model, batch, budget,
    optimizer, device, loss_fn, ...)`` still works for one release, with a warning (Note 1).
    """
    if not isinstance(job, Job):
        _deprecated("plan")
        return _plan(job, *args, **kwargs)
    return _plan_job(job, *args, **kwargs)


def fit(job: Job, *args, **kwargs) -> Runner:
    """A ``Runner`` that trains ``job``'s model one effective batch per ``runner.step(batch)``.

    ``fit(job, budget=None, device=None, **knobs)``: under ``budget`` the plan is made
    (knobs given here kept) and applied; below the floor it raises ``memfit.BudgetTooSmall``.
    ``allow_numerics_change`` and ``batches`` as ``memfit.plan`` takes them. The job's
    optimizer should be an instance over the model's parameters (or a factory). The old form
    ``fit(model, optimizer, batch, budget, device, loss_fn, ...)`` still works for one release,
    with a warning (Note 1).
    """
    if not isinstance(job, Job):
        _deprecated("fit")
        return _fit(job, *args, **kwargs)
    return _fit_job(job, *args, **kwargs)


def _estimate_job(job: Job, device=None, **knobs) -> Estimate:
    _refuse_job_fields("estimate", knobs)
    knobs = expand_groups(knobs)
    args = job.arguments()
    args["batch"] = _traced_batch(job)
    return _estimate(device=device, **args, **knobs)


def _plan_job(job: Job, budget=None, device=None, **fixed) -> Plan:
    _refuse_job_fields("plan", fixed)
    fixed = expand_groups(fixed)
    args = job.arguments()
    args["batch"] = _traced_batch(job)
    return _plan(args.pop("model"), args.pop("batch"), budget, args.pop("optimizer"), device,
                 **args, **fixed)


def _fit_job(job: Job, budget=None, device=None, **knobs) -> Runner:
    _refuse_job_fields("fit", knobs)
    knobs = expand_groups(knobs)
    args = job.arguments()
    if job.max_seq_len is not None:
        args["max_seq_len"] = job.max_seq_len
    return _fit(args.pop("model"), args.pop("optimizer"), args.pop("batch"), budget, device,
                **args, **knobs)


def _traced_batch(job: Job):
    """The batch ``estimate`` and ``plan`` trace: the job's, or its longest (Note 2)."""
    if job.max_seq_len is None:
        return job.batch
    return extend_batch(prepare_batch(job.batch), job.max_seq_len)


def _refuse_job_fields(front: str, kwargs: dict) -> None:
    """A Job's field given again as a keyword: a TypeError naming where it belongs."""
    given = [n for n in _JOB_FIELDS if n in kwargs]
    if given:
        names = ", ".join(given)
        raise TypeError(f"{front}(job, ...) got {names}: the Job holds it; make the job with "
                        f"it (memfit.Job(model, batch, {given[0]}=...), or "
                        f"job.replace({given[0]}=...))")


def _deprecated(front: str) -> None:
    """One ``MemfitDeprecationWarning`` at the caller of ``memfit.<front>`` (Note 1)."""
    warnings.warn(f"{_OLD_FORM[front]} is deprecated and goes in the next release: use "
                  f"{_NEW_FORM[front]}", MemfitDeprecationWarning, stacklevel=3)


def _show_new_form(front, impl) -> None:
    """What ``help`` and ``inspect.signature`` show for ``front``: the new form (Note 1)."""
    front.__signature__ = inspect.signature(impl).replace(
        return_annotation=inspect.signature(front).return_annotation)


_show_new_form(estimate, _estimate_job)
_show_new_form(plan, _plan_job)
_show_new_form(fit, _fit_job)
