"""``estimate(trainer)``: one steady-state optimizer step of ``trainer.train()``, traced."""

from __future__ import annotations

from memfit.api._setup import resolve_device
from memfit.api.estimate import Estimate
from memfit.api.estimate import estimate as _estimate
from memfit.integrations._hf_precision import user_precision
from memfit.integrations._hf_recompute import check
from memfit.integrations._hf_step import (TrainerStep, check_supported, choose_batch,
                                          trainer_optimizer, trainer_scheduler)
from memfit.techniques.optimizer_offload import OffloadedOptimizer

__all__ = ["estimate"]


def estimate(trainer, device=None, *, batch=None, budget=None, **knobs) -> Estimate:
    """Predict the memory of one steady-state optimizer step of ``trainer.train()``.

    Everything the Trainer decides is taken from it (``_hf_step.TrainerStep`` runs its step): its
    own ``training_step`` and ``compute_loss`` over ``gradient_accumulation_steps`` micro-batches of
    ``per_device_train_batch_size`` samples from its data collator, the loss scaling,
    ``bf16``/``fp16`` autocast as accelerate applies it, ``gradient_checkpointing`` with its kwargs,
    ``max_grad_norm``, the optimizer ``args.optim`` builds (or the one the trainer was given) and
    the ``lr_scheduler_type`` scheduler. Neither the trainer nor its model is changed. ``device``: a
    GPU name, "cpu" or a ``DeviceSpec`` (default: where the model is); ``budget`` sets what ``fits``
    checks. ``batch``: the traced batch instead of the longest step the train dataset can make (its
    longest samples dealt into the micro-batches, the longest last; the first samples where all have
    one length; said in ``Estimate.notes``) (``{"micro_batches": [...], "look_ahead": ...}``, as
    ``trainer_batch`` makes it). ``knobs``: what memfit adds through the model and the optimizer
    (``checkpoint``, ``offload``, ``offload_optimizer``, ``optimizer_impl``); the rest is the
    TrainingArguments' (change them there). After ``fit`` the estimate is of the fitted trainer (its
    arguments, the block hooks on its model, its offloaded optimizer). For a GPU ``device`` the step
    is traced as it runs here (accelerate's autocast of this machine) and put through memfit's CUDA
    models (transformers' checkpointing included: ``_hf_recompute``).
    """
    check_supported(trainer)
    check_gpu_checkpointing(trainer, device)
    check_offload_runs(trainer, device)
    chosen = choose_batch(trainer) if batch is None else None
    batch = chosen.batch if chosen is not None else batch
    step = TrainerStep(trainer)
    optimizer = trainer_optimizer(trainer)
    if isinstance(optimizer, OffloadedOptimizer):      # fit's: the class it wraps, offloaded
        saved, trainer.optimizer = trainer.optimizer, None
        try:
            optimizer = trainer_optimizer(trainer)
        finally:
            trainer.optimizer = saved
        knobs.setdefault("offload_optimizer", True)
    est = _estimate(trainer.model, batch, optimizer=optimizer, device=device, budget=budget,
                    step=step, scheduler=trainer_scheduler(trainer), **knobs)
    est.notes.append(chosen.note if chosen is not None else "batch: the one given (batch=)")
    est.knobs = est.knobs.replace(precision=user_precision(trainer.args))   # the step's own
    return est


def check_gpu_checkpointing(trainer, device) -> None:
    """transformers' own activation checkpointing for a GPU target is traced with its recompute
    under the CUDA models (``_hf_recompute``), through checkpoint's ``context_fn``: refused only
    where that cannot be passed (``use_reentrant=True``), with the fix."""
    if resolve_device(trainer.model, device).kind != "cuda":
        return
    if trainer.args.activation_checkpointing:
        check(trainer.args.activation_checkpointing_kwargs)


def check_offload_runs(trainer, device) -> None:
    """transformers' checkpoint ``offload`` pins its host copies on the machine's accelerator
    (``save_on_cpu(pin_memory=True)``); on a machine without one ``train()`` stops in
    ``pin_memory``: a CPU target there is refused with the fix, not estimated as if it ran."""
    args = trainer.args
    if not (args.activation_checkpointing and
            (args.activation_checkpointing_kwargs or {}).get("offload")):
        return
    from transformers.utils.import_utils import get_current_accelerator
    if resolve_device(trainer.model, device).kind == "cpu" and get_current_accelerator() is None:
        raise ValueError(
            "activation_checkpointing_kwargs offload=True: transformers pins the offloaded "
            "inputs (save_on_cpu(pin_memory=True)), which needs a GPU, and this machine has "
            "none, so trainer.train() would stop in pin_memory. Remove offload (on the CPU host "
            "and device are one memory: it saves nothing), or estimate for a GPU "
            "(device='a100-80gb') to run there")
