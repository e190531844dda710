"""Plan exports: a ``Plan`` as Hugging Face ``TrainingArguments`` keywords, an Accelerate config
file, or a DeepSpeed config, with a note for everything that does not carry over.

Every exporter returns an ``Export``: ``config``, a JSON-able dict in the target's own key names,
and ``notes``, one line per choice the target cannot express and what the export does instead.
Where a target cannot do what the plan does, the export takes the choice that needs no more
device memory (recompute more, never less) and says so; where no such choice exists, the note
says the peak may exceed memfit's prediction. ``batch_size`` is the batch of one optimizer step
on one device: the batch the plan was made for.

What maps:
  precision          TrainingArguments fp16/bf16 and Accelerate mixed_precision are autocast
                     (fp16 with a GradScaler), as memfit's fp16/bf16. DeepSpeed: Note 2.
  micro-batching     per-device micro-batch x accumulation steps (Note 1).
  max_grad_norm      max_grad_norm / gradient_clipping, the user's setting; a plan that does not
                     clip leaves the target's default in place (the Trainer clips at 1.0) and
                     the note says so: writing 0.0 would silently turn the default off.
  recompute          transformers' activation checkpointing (Note 3); DeepSpeed's
                     activation_checkpointing section (Note 4).
  recompute+offload  the ``offload`` of transformers' checkpointing, DeepSpeed's
                     cpu_checkpointing: both keep a recomputed block's inputs on the host.
  offload_optimizer  DeepSpeed ZeRO ``offload_optimizer`` (Note 5), in Accelerate through its
                     deepspeed_config section.
What it needs: ``Export.knobs`` are memfit's knobs for exactly what the export runs (the
target's own choices where it cannot follow the plan: no optimizer offload in the Trainer, its
default clipping, full recompute for selective). ``memfit.api.export_traced`` re-traces them
and fills ``predicted_device_bytes``, with a note when that exceeds the plan's budget.
What does not: selective recompute (exported as full recompute), offload without recompute
(exported as recompute+offload), a last micro-batch smaller than the others, DTR (``remat``).

Note 1 (micro-batches). A target runs ``steps`` equal micro-batches, where memfit cuts a batch
into chunks of ``micro_batch_size`` and a smaller last one: ``steps = ceil(batch / micro)`` keeps
the plan's micro-batch (hence its memory) but makes the effective batch ``micro * steps``, so the
note names the largest divisor of the batch not above the plan's micro-batch
(``_export_parts``, which holds the reading of the plan every target shares).

Note 2 (DeepSpeed precision). DeepSpeed's ``fp16``/``bf16`` sections are not autocast: they cast
the model and keep fp32 master weights in the optimizer. ``bf16`` is therefore memfit's
``bf16-pure``; memfit's autocast ``fp16``/``bf16`` export to them with a note (numerics and the
memory split differ). The fp16 loss scaler is set as ``torch.amp.GradScaler``'s defaults
(2**16 to start, doubled after 2000 clean steps, halved at the first overflow).

Note 3 (transformers checkpointing). transformers recomputes its ``GradientCheckpointingLayer``s
(memfit's blocks in a transformers model). Versions with ``activation_checkpointing`` (checked
on 5.24) take ``every_n_layers`` (layers 0, n, 2n, ... are recomputed) and ``offload``; older
ones (``gradient_checkpointing``) recompute every layer or none. A plan's subset of blocks
becomes ``n = blocks // recomputed``, which recomputes at least as many blocks as the plan;
which blocks can differ (the note lists the plan's). ``offload`` applies to every recomputed
layer. A plan that lists no blocks (made by hand, never applied) is exported from its policy.

Note 4 (DeepSpeed). Its export, activation checkpointing and ZeRO stages: ``planner._export_deepspeed``.

Note 5 (where transformers' offload runs). transformers offloads a checkpointed layer's inputs
with ``save_on_cpu(pin_memory=True)``, pinning on the machine's accelerator; without one (a
CPU-only machine) the pinned allocation fails and ``trainer.train()`` stops in ``pin_memory``.
An export runs where the plan was made: a plan for the CPU is exported without ``offload``
(there host and device are one memory, so the offload saved no bytes a person could use) and
its knobs, hence ``predicted_device_bytes``, count the inputs kept; a plan that records no
device keeps ``offload`` and says that it needs a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from memfit.planner._export_deepspeed import to_deepspeed_config
from memfit.planner._export_parts import (Export, _activations, _batching, _check_world, _clip,
                                         _common_notes, _exported, _names, _precision,
                                         _Activations)

if TYPE_CHECKING:
    from memfit.planner.plan import Plan

__all__ = ["Export", "TARGETS", "export", "to_accelerate_config", "to_deepspeed_config",
           "to_training_arguments"]

TARGETS = ("transformers", "accelerate", "deepspeed")
def export(plan: "Plan", target: str, batch_size: int, world_size: int = 1) -> Export:
    """``to_training_arguments`` ("transformers"), ``to_accelerate_config`` ("accelerate") or
    ``to_deepspeed_config`` ("deepspeed"); TrainingArguments are per device (no world_size)."""
    if target == "transformers":
        return to_training_arguments(plan, batch_size)
    if target == "accelerate":
        return to_accelerate_config(plan, batch_size, world_size)
    if target == "deepspeed":
        return to_deepspeed_config(plan, batch_size, world_size)
    raise ValueError(f"export target {target!r} is not one of {', '.join(TARGETS)}")


def to_training_arguments(plan: "Plan", batch_size: int) -> Export:
    """Keywords for ``transformers.TrainingArguments`` (for this installed transformers)."""
    from transformers import TrainingArguments

    fields = frozenset(f.name for f in dataclasses.fields(TrainingArguments))
    return _training_arguments(plan, batch_size, fields)


def _training_arguments(plan: "Plan", batch_size: int, fields: frozenset[str]) -> Export:
    notes: list[str] = []
    b = _batching(plan, batch_size, "the Trainer", notes)
    precision = _precision(plan)
    config = {"per_device_train_batch_size": b.micro, "gradient_accumulation_steps": b.steps,
              "fp16": precision == "fp16", "bf16": precision in ("bf16", "bf16-pure"),
              **_clip(plan, "max_grad_norm", "the Trainer", 1.0, notes)}
    if precision == "bf16-pure":
        notes.append("bf16-pure: the Trainer's bf16 is autocast over fp32 weights; for pure bf16 "
                     "cast the model (model.to(torch.bfloat16)) before the Trainer, which then "
                     "keeps no fp32 master weights (memfit's bf16-pure does): the memory "
                     "differs from the plan's")
    new = "activation_checkpointing" in fields
    flag = "activation_checkpointing" if new else "gradient_checkpointing"
    acts = _activations(plan, notes)
    if new and acts.offload:
        acts = _offload_where_planned(plan, acts, notes)
    n = _every_n(acts, notes)
    config[flag] = n is not None
    if n is not None:
        kwargs: dict = {"use_reentrant": False}
        if new and n > 1:
            kwargs["every_n_layers"] = n
        elif n > 1:
            notes.append(f"this transformers checkpoints every layer or none: every layer is "
                         f"recomputed, not every {n}th (less memory, slower)")
        if new and acts.offload:
            kwargs["offload"] = True
        elif acts.offload:
            notes.append("this transformers cannot offload checkpointed inputs: they stay on the "
                         "device, so the peak may exceed memfit's prediction by those inputs")
        config[flag + "_kwargs"] = kwargs
    if plan.knobs.offload_optimizer:
        notes.append("offload_optimizer: no TrainingArguments optim keeps its state on the host, "
                     "so this export keeps it on the device (more memory than the plan: see "
                     "predicted_device_bytes); for the plan's memory pass "
                     "deepspeed=to_deepspeed_config(...).config (needs deepspeed)")
    impl = plan.knobs.optimizer_impl if not plan.knobs.offload_optimizer else None
    if impl == "fused":
        config["optim"] = "adamw_torch_fused"
        notes.append("optim adamw_torch_fused: the plan steps a fused optimizer; for another "
                     "optimizer than AdamW pass it yourself with fused=True (optimizers=...)")
    elif impl is not None:
        notes.append(f"the plan steps the optimizer {impl} (foreach="
                     f"{impl == 'foreach'}): pass it yourself (optimizers=...), no optim "
                     "value selects that")
    notes.append("optim: the plan does not record the optimizer; set optim to the one memfit "
                 "planned with (its state is part of the predicted peak)")
    _common_notes(plan, notes)
    clip = config.get("max_grad_norm", 1.0) or None
    return Export(config, tuple(notes), _exported(
        plan, b, _trainer_recomputes(acts, n, new),
        precision="bf16" if precision == "bf16-pure" else precision, clip=clip,
        offload_optimizer=False, optimizer_impl=impl if impl == "fused" else None))


def _offload_where_planned(plan: "Plan", acts: _Activations, notes: list[str]) -> _Activations:
    """Note 5: transformers' offload only where the plan's device can pin host memory."""
    if plan.device == "cpu":
        notes.append("offload: transformers pins the offloaded inputs (save_on_cpu(pin_memory="
                     "True)), which needs a GPU, and this plan is for the CPU, where "
                     "trainer.train() would stop in pin_memory: exported without offload (on the "
                     "CPU host and device are one memory; the recomputed blocks' inputs stay "
                     "there and predicted_device_bytes counts them)")
        return dataclasses.replace(acts, offload=False)
    if plan.device is None:
        notes.append("offload: transformers pins the offloaded inputs, which needs a GPU: on a "
                     "CPU-only machine trainer.train() stops in pin_memory (the plan records no "
                     "device); remove offload from activation_checkpointing_kwargs there")
    return acts


def _trainer_recomputes(acts: _Activations, n: int | None, new: bool) -> _Activations:
    """What the Trainer recomputes for ``every_n_layers=n`` (Note 3): layers 0, n, 2n, ... (every
    layer on an old transformers), offloaded only on a new one."""
    if n is None:
        return _Activations(acts.blocks, (), (), None, False)
    step = n if new else 1
    if acts.blocks is None:
        return _Activations(None, (), (), step, acts.offload and new)
    return _Activations(acts.blocks, tuple(range(0, acts.blocks, step)), (), None,
                        acts.offload and new)


def _every_n(acts: _Activations, notes: list[str]) -> int | None:
    """Note 3: recompute layers 0, n, 2n, ... ; None: no recompute."""
    if acts.blocks is None:
        return acts.every
    if not acts.recompute:
        return None
    n = acts.blocks // len(acts.recompute)
    if tuple(range(0, acts.blocks, n)) != acts.recompute:
        count = len(range(0, acts.blocks, n))
        what = "every layer" if n == 1 else f"every {n}th layer from the first"
        notes.append(f"transformers recomputes {what} ({count} of {acts.blocks}); the plan "
                     f"recomputes {len(acts.recompute)}: {_names(acts.names)} (uniform layers: "
                     "no more memory than the plan)")
    return n


# -- Accelerate ---------------------------------------------------------------------------------

_MIXED = {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16"}


def to_accelerate_config(plan: "Plan", batch_size: int, world_size: int = 1) -> Export:
    """What ``accelerate config`` writes (``ClusterConfig`` keys; ``Export.to_yaml`` for the file).

    The file has no key for accumulation, clipping or checkpointing outside DeepSpeed/FSDP (an
    unknown key is an error): those go in the notes, as code to write."""
    _check_world(world_size)
    notes: list[str] = []
    b = _batching(plan, batch_size, "Accelerate", notes)
    precision = _precision(plan)
    config = {"compute_environment": "LOCAL_MACHINE",
              "distributed_type": "NO" if world_size == 1 else "MULTI_GPU",
              "mixed_precision": _MIXED[precision], "num_machines": 1, "machine_rank": 0,
              "num_processes": world_size, "main_training_function": "main", "use_cpu": False,
              "debug": False}
    notes.append(f"in your script: a DataLoader batch_size of {b.micro}")
    if precision == "bf16-pure":
        notes.append("bf16-pure: mixed_precision bf16 is autocast over fp32 weights; cast the "
                     "model to bf16 yourself for pure bf16 (no fp32 master weights then)")
    if plan.knobs.offload_optimizer:
        config["distributed_type"] = "DEEPSPEED"
        ds = {"zero_stage": 2, "offload_optimizer_device": "cpu", "offload_param_device": "none",
              "zero3_init_flag": False, "gradient_accumulation_steps": b.steps}
        if plan.knobs.max_grad_norm is not None:
            ds["gradient_clipping"] = float(plan.knobs.max_grad_norm)
        config["deepspeed_config"] = ds
        notes.append("offload_optimizer: DeepSpeed ZeRO-2 with CPU optimizer offload (exports "
                     "Note 5); DeepSpeed refuses a torch optimizer with it unless "
                     "zero_force_ds_cpu_optimizer is false, which these keys cannot set: use "
                     "deepspeed.ops.adam.DeepSpeedCPUAdam, or replace deepspeed_config by "
                     "{deepspeed_config_file: <to_deepspeed_config(...) as JSON>}")
        if precision != "fp32":
            notes.append("under DeepSpeed, mixed_precision casts the model and keeps fp32 master "
                         "weights (not autocast): exports Note 2")
    else:
        notes.append(f"in your script: Accelerator(gradient_accumulation_steps={b.steps}) and "
                     "`with accelerator.accumulate(model):` around each micro-batch")
        if plan.knobs.max_grad_norm is not None:
            notes.append(f"in your script: accelerator.clip_grad_norm_(model.parameters(), "
                         f"{float(plan.knobs.max_grad_norm)}) when accelerator.sync_gradients")
    acts = _activations(plan, notes)
    if acts.recompute or acts.every is not None:
        notes.append("recompute" + ("+offload" if acts.offload else "") + ": the config has no "
                     "activation checkpointing; enable it on the model before accelerator.prepare "
                     "(transformers: the model's activation/gradient_checkpointing_enable, with "
                     "the keywords to_training_arguments gives)")
    _common_notes(plan, notes)
    mixed = "bf16" if precision == "bf16-pure" else precision
    return Export(config, tuple(notes), _exported(
        plan, b, acts, precision=mixed, clip=plan.knobs.max_grad_norm,
        offload_optimizer=bool(plan.knobs.offload_optimizer),
        optimizer_impl=plan.knobs.optimizer_impl))
