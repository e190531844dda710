"""One optimizer step of ``Trainer.train()`` as a memfit user step (``step=fn``).

Note 1 (what a step of ``trainer.train()`` is, transformers 5.x). ``Trainer._run_epoch`` takes
``gradient_accumulation_steps`` micro-batches from the train dataloader at once
(``get_batch_samples``: they stay alive in one list for the whole step), counts their
``num_items_in_batch`` (labels != -100, shifted for causal LMs), and for each one calls the
Trainer's own ``training_step`` (``compute_loss`` -> the loss divided by the accumulation
count unless the model normalised it by ``num_items_in_batch`` -> ``accelerator.backward``),
keeps the detached loss (``tr_loss_step``, alive until the next one replaces it) and adds it
into the running ``_tr_loss`` (a 0-d tensor, in place), after a NaN/inf check
(``torch.isnan``/``isinf``: two 1-byte temporaries). After the last micro-batch it clips
(``accelerator.clip_grad_norm_`` with ``max_grad_norm``, or the same norm with ``inf`` when
``max_grad_norm`` is 0, so the norm is always computed), keeps that ``grad_norm`` until the next
step's clip, runs ``optimizer.step()``, ``lr_scheduler.step()`` and ``model.zero_grad()``
(``set_to_none=True``, so no gradient is alive when the next step's forward starts).
accelerate's ``DataLoaderShard`` reads one batch ahead: one more micro-batch is alive during
every step but the last of an epoch. ``TrainerStep`` runs exactly this, calling the Trainer's
own methods (a subclass's ``training_step``/``compute_loss`` included), on the fakes memfit
passes in; the look-ahead batch is carried in the traced batch. The LR scheduler is built on
the fake optimizer and stepped by ``estimate`` right after the step (after ``zero_grad``, not
before it: it holds no tensors, so the order changes no byte).

Note 2 (what ``train()`` does to the model first). ``train()`` turns on activation
checkpointing (``args.gradient_checkpointing`` with its kwargs, ``use_reentrant=False`` unless
they say otherwise) and ``accelerator.prepare`` wraps the model's ``forward`` in autocast (bf16,
or fp16 where the device supports it) with outputs converted to fp32. A trace receives a fake
deep copy of the model as it is *now*, usually before ``train()``: on its first call the step
does the same two things to that copy, through the model's own
``activation_checkpointing_enable`` and accelerate's own ``prepare_model`` (device placement
off; the copy is taken off the accelerator's model list again). For a GPU target the copy's
checkpointing recomputes under the same CUDA models as its forward (``_hf_recompute``). The
user's model and the trainer are not changed; the trainer's loop state the step touches (the
accumulation count, accelerate's sync flag, the mixed-mesh cache) is restored after the call.

Note 3 (the batch). ``trainer_batch`` collates the trainer's train dataset with the trainer's
own collator (unused columns removed as ``get_train_dataloader`` does):
``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size`` samples, and
the look-ahead one when the dataset has it. Where the samples differ in length (a padding
collator pads each micro-batch to its longest sample, and the sampler shuffles), the traced
step is the longest one the dataloader can produce: the ``(steps + 1) x b`` longest samples
dealt one by one into the micro-batches, so the i-th longest micro-batch holds the i-th longest
sample (no step can pad its i-th longest micro-batch longer), the longest one last (every
gradient is alive through its backward) and the shortest as the look-ahead. Where every
sample has the same length (or the dataset is iterable, so its lengths are unknown) the first
samples are traced, in dataset order. ``BatchChoice.note`` says which (``estimate`` puts it in
``Estimate.notes``); ``batch=`` traces another.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, IterableDataset

from memfit.integrations._hf_recompute import model_recompute

__all__ = ["TrainerStep", "BatchChoice", "trainer_batch", "choose_batch", "trainer_optimizer",
           "trainer_scheduler", "check_supported", "MICRO", "AHEAD"]

MICRO = "micro_batches"      # the traced batch: {MICRO: [micro-batch, ...], AHEAD: batch}
AHEAD = "look_ahead"


def check_supported(trainer) -> None:
    """A ValueError naming the setting when the trainer runs something this step does not
    model (distributed, compiled, DeepSpeed/FSDP, NEFTune, Liger kernels)."""
    import transformers
    if not isinstance(trainer, transformers.Trainer):
        raise ValueError(f"give a transformers.Trainer (built with the model, TrainingArguments and "
                         f"train_dataset), got {type(trainer).__name__}: for a bare model use "
                         "memfit.estimate(model, batch) / memfit.fit(model, optimizer, batch)")
    args = trainer.args
    refused = [
        (args.world_size > 1, f"world_size={args.world_size} (one process per device is "
                              "supported; estimate one rank with memfit.estimate(gpus=...))"),
        (args.n_gpu > 1, f"n_gpu={args.n_gpu} (DataParallel)"),
        (getattr(trainer, "is_deepspeed_enabled", False), "DeepSpeed"),
        (getattr(trainer, "is_fsdp_enabled", False), "FSDP"),
        (bool(args.torch_compile), "torch_compile=True (memfit traces the eager model)"),
        (trainer.neftune_noise_alpha is not None, "neftune_noise_alpha"),
        (bool(args.use_liger_kernel), "use_liger_kernel=True"),
    ]
    bad = [why for cond, why in refused if cond]
    if bad:
        raise ValueError("memfit.integrations.transformers models a single-process eager "
                         f"Trainer; this one uses {', '.join(bad)}. Turn it off for the estimate, "
                         "or measure the real run with MemfitCallback")


@dataclass(frozen=True)
class BatchChoice:
    """The traced batch and which one it is (Note 3)."""

    batch: dict            # {MICRO: [...], AHEAD: batch or absent}
    note: str


def trainer_batch(trainer) -> dict:
    """The traced batch (Note 3): ``{MICRO: [...], AHEAD: batch or absent}``."""
    return choose_batch(trainer).batch


def choose_batch(trainer) -> BatchChoice:
    """The traced batch and a line saying which (Note 3)."""
    if trainer.train_dataset is None:
        raise ValueError("the trainer has no train_dataset: pass train_dataset=... to Trainer "
                         "(or batch=... to estimate)")
    dataset, collator = trainer.train_dataset, trainer.data_collator
    try:
        import datasets
        is_hf_dataset = isinstance(dataset, datasets.Dataset)
    except ImportError:
        is_hf_dataset = False
    if is_hf_dataset:
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    need = trainer.args.gradient_accumulation_steps + 1
    b = trainer._train_batch_size
    longest = _longest_groups(dataset, b, need)
    if longest is not None:
        groups, lengths = longest
        batches = [collator([dataset[i] for i in g]) for g in groups]
        out = {MICRO: batches[:need - 1][::-1], AHEAD: batches[-1]}    # longest last
        return BatchChoice(out, (
            "batch: the longest step the dataloader can produce (samples differ in length): "
            f"micro-batches padded to their longest samples, {', '.join(map(str, lengths))} "
            "long; shorter steps need less. Pass batch= to estimate another"))
    loader = DataLoader(dataset, batch_size=b, collate_fn=collator,
                        shuffle=False, num_workers=0,
                        drop_last=trainer.args.dataloader_drop_last)
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == need:
            break
    if len(batches) < need - 1:
        size = "an iterable dataset" if isinstance(dataset, IterableDataset) else \
            f"{len(dataset)} samples"
        raise ValueError(
            f"the train dataset ({size}) holds fewer than gradient_accumulation_steps="
            f"{need - 1} batches of {trainer._train_batch_size}: memfit estimates a whole "
            "optimizer step; give more samples or lower gradient_accumulation_steps")
    out = {MICRO: batches[:need - 1]}
    if len(batches) == need:
        out[AHEAD] = batches[-1]
    why = "its lengths are unknown (an iterable dataset)" if isinstance(dataset, IterableDataset) \
        else "every sample has the same length"
    return BatchChoice(out, f"batch: the first {len(batches) * b} samples of the train dataset "
                            f"({why})")


def _longest_groups(dataset, b: int, need: int):
    """Note 3: ``need`` groups of ``b`` sample indices, the i-th holding the i-th longest
    sample, and each group's longest length; None where lengths are equal or unknown."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or \
            len(dataset) < need * b:
        return None
    lengths = [_length(dataset[i]) for i in range(len(dataset))]
    if None in lengths or len(set(lengths)) < 2:
        return None
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))[:need * b]
    groups = [order[k::need] for k in range(need)]
    return groups, [lengths[g[0]] for g in groups][:need - 1][::-1]


def _length(sample):
    """A sample's sequence length: its longest list or 1-D+ tensor value (None: none)."""
    if not isinstance(sample, dict):
        return None
    sizes = [len(v) if isinstance(v, (list, tuple)) else v.shape[0] for v in sample.values()
             if isinstance(v, (list, tuple)) or isinstance(v, torch.Tensor) and v.dim() > 0]
    return max(sizes) if sizes else None


def trainer_optimizer(trainer, model: nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer ``train()`` steps: the trainer's own if it was given one, else a fresh one
    built by the trainer's ``create_optimizer`` (``args.optim``, its param groups) over
    ``model`` (default: the trainer's). The trainer keeps no reference to a fresh one."""
    if trainer.optimizer is not None:
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)   # accelerate's
        return inner
    try:
        return trainer.create_optimizer(model if model is not None else trainer.model)
    finally:
        trainer.optimizer = None


def trainer_scheduler(trainer):
    """A factory ``optimizer -> LR scheduler`` as ``create_scheduler`` builds it
    (``lr_scheduler_type``, warm-up and kwargs of the args)."""
    from transformers.optimization import get_scheduler
    args = trainer.args
    total = args.max_steps if args.max_steps > 0 else 1000
    return lambda optimizer: get_scheduler(
        args.lr_scheduler_type, optimizer=optimizer,
        num_warmup_steps=args.get_warmup_steps(total), num_training_steps=total,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs)


@dataclass
class _Carry:
    """What ``_run_epoch`` keeps from one optimizer step to the next (Note 1)."""

    tr_loss: torch.Tensor | None = None         # Trainer._tr_loss
    tr_loss_step: torch.Tensor | None = None    # the last micro-batch's detached loss
    grad_norm: torch.Tensor | None = None       # the last clip's norm
    prepared: bool = False          # Note 2 done on this (fake) model


class TrainerStep:
    """``fn(model, batch, optimizer)``: one optimizer step of ``trainer.train()`` (Note 1)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._carry: "weakref.WeakKeyDictionary[nn.Module, _Carry]" = weakref.WeakKeyDictionary()
        self.__name__ = f"{type(trainer).__name__}.training_step"

    def __call__(self, model, batch, optimizer):
        t, args = self.trainer, self.trainer.args
        carry = self._carry.setdefault(model, _Carry())
        if not carry.prepared:
            self._prepare(model)
            carry.prepared = True
            carry.tr_loss = torch.tensor(0.0)
        for x in tree_leaves(batch):     # alive all step (Note 1)
            if isinstance(x, torch.Tensor):
                x.detach()
        micro = batch[MICRO]
        with _loop_state(t):
            num_items = t._get_num_items_in_batch(micro, args.device)
            t.current_gradient_accumulation_steps = len(micro)
            for i, inputs in enumerate(micro):
                t.accelerator.gradient_state._set_sync_gradients(i == len(micro) - 1)
                loss = t.training_step(model, inputs, num_items)
                if args.logging_nan_inf_filter:        # the loop's check; a trace cannot read it
                    torch.isnan(loss)
                    torch.isinf(loss)
                carry.tr_loss_step = loss
                carry.tr_loss += loss
            carry.grad_norm = None
            grad_norm = t._clip_grad_norm(model) if args.max_grad_norm > 0 else None
            carry.grad_norm = t._get_grad_norm(model, grad_norm=grad_norm)
            optimizer.step()
            model.zero_grad()
        return carry.tr_loss_step

    def _prepare(self, model: nn.Module) -> None:
        """What ``train()`` does to the model before its first step, on the copy (Note 2)."""
        t, args = self.trainer, self.trainer.args
        if args.activation_checkpointing and not getattr(model, "is_activation_checkpointing",
                                                         False):
            kw = dict(args.activation_checkpointing_kwargs or {})
            every = kw.pop("every_n_layers", 1)
            offload = kw.pop("offload", False)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw or None,
                                                  every_n_layers=every, offload=offload)
        model_recompute(model)          # for a GPU target: its recompute in the models too
        acc = t.accelerator
        if acc.native_amp and not getattr(model, "_is_accelerate_prepared", False) and \
                "forward" not in vars(model):
            acc.prepare_model(model, device_placement=False)
            acc._models[:] = [m for m in acc._models if m is not model]


@contextlib.contextmanager
def _loop_state(trainer):
    """Restore the trainer's loop attributes the step sets (Note 2)."""
    missing = object()
    saved = {k: vars(trainer).get(k, missing)
             for k in ("current_gradient_accumulation_steps", "_mixed_mesh_grads")}
    gs = trainer.accelerator.gradient_state
    sync = gs.sync_gradients
    try:
        yield
    finally:
        gs._set_sync_gradients(sync)
        for k, v in saved.items():
            if v is missing:
                vars(trainer).pop(k, None)
            else:
                setattr(trainer, k, v)
