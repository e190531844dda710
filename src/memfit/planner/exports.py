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

Note 1 (micro-batches). memfit cuts a batch into chunks of ``micro_batch_size`` and a smaller
last chunk (``Accumulation.split``); the targets run ``steps`` equal micro-batches. With
``steps = ceil(batch / micro)`` the micro-batch, hence the memory, is the plan's, but the
effective batch becomes ``micro * steps``; the note names the largest divisor of the batch not
above the plan's micro-batch, which keeps the batch and needs no more memory per micro-batch.

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
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.knobs import Knobs

if TYPE_CHECKING:
    from memfit.planner.plan import Plan

__all__ = ["Export", "TARGETS", "export", "to_accelerate_config", "to_deepspeed_config",
           "to_training_arguments"]

TARGETS = ("transformers", "accelerate", "deepspeed")
_RECOMPUTED = ("recompute", "selective", "recompute+offload", "selective+offload")


@dataclass(frozen=True)
class Export:
    """A plan in a target's terms: ``config`` (JSON-able, the target's key names) and ``notes``
    (what does not map, and what the config does instead)."""

    config: dict
    notes: tuple[str, ...] = ()
    knobs: "Knobs | None" = None          # memfit's knobs for what the export runs
    predicted_device_bytes: int | None = None   # those knobs re-traced (export_traced)
    # DeepSpeed: ZeRO stage -> memfit's predicted bytes per rank (_export_deepspeed Note 3)
    per_rank_bytes: dict | None = None

    def to_json(self) -> str:
        """The config alone (JSON has no comments: read ``notes`` beside it)."""
        return json.dumps(self.config, indent=2)

    def to_yaml(self) -> str:
        """The config as YAML, the notes as comments above it (Accelerate's format)."""
        import yaml   # PyYAML: a dependency of transformers, needed only here

        head = "".join(f"# {n}\n" for n in self.notes)
        return head + yaml.safe_dump(self.config, sort_keys=False)


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


# -- what every target needs ---------------------------------------------------------------------

@dataclass(frozen=True)
class _Batching:
    micro: int      # samples per micro-batch (per device)
    steps: int      # micro-batches per optimizer step


def _batching(plan: "Plan", batch_size: int, target: str, notes: list[str]) -> _Batching:
    """Note 1."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int (samples per optimizer step on one "
                         f"device), got {batch_size!r}")
    micro = min(plan.knobs.micro_batch_size or batch_size, batch_size)
    steps = math.ceil(batch_size / micro)
    if micro * steps != batch_size:
        last = batch_size - micro * (steps - 1)
        divisor = max(d for d in range(1, micro + 1) if batch_size % d == 0)
        notes.append(
            f"micro-batches: memfit splits {batch_size} into {steps - 1} x {micro} + {last}; "
            f"{target} runs {steps} x {micro}, an effective batch of {micro * steps} per device, "
            f"not {batch_size}. For {batch_size} exactly use micro_batch_size={divisor} "
            f"({batch_size // divisor} steps): no more memory per micro-batch")
    return _Batching(micro, steps)


def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (data-parallel processes), "
                         f"got {world_size!r}")


def _precision(plan: "Plan") -> str:
    p = plan.knobs.precision or "fp32"      # the API's default: the user's fp32
    if p == "auto":
        raise ValueError("the plan's precision is 'auto', a choice memfit has not made yet: "
                         "export the plan memfit.plan (or runner.plan) returned, or fix precision")
    return p


def _clip(plan: "Plan", key: str, target: str, default: float, notes: list[str]) -> dict:
    """The user's clipping as ``{key: value}``; none set: the target's default, said so."""
    if plan.knobs.max_grad_norm is not None:
        return {key: float(plan.knobs.max_grad_norm)}
    notes.append(f"{key}: the plan does not clip (max_grad_norm unset), and the export leaves "
                 f"{target}'s default in place: it clips the gradient norm at {default:g}. Set "
                 f"{key}=0.0 to run without clipping, as the plan does")
    return {}


def _exported(plan: "Plan", b: "_Batching", acts: "_Activations", *, precision: str,
              clip: float | None, offload_optimizer: bool, optimizer_impl: str | None) -> Knobs:
    """memfit's knobs for what an export runs (module docstring, "What it needs")."""
    blocks = list(plan.blocks)
    if acts.blocks is None:
        ckpt = "none" if acts.every is None else "all" if acts.every == 1 else f"every:{acts.every}"
    elif not acts.recompute:
        ckpt = "none"
    else:
        ckpt = tuple(blocks[i] for i in acts.recompute)
        ckpt = "all" if len(ckpt) == len(blocks) else ckpt
    # no export maps memfit's block-weight offload (_common_notes): the weights on the device
    return plan.knobs.replace(precision=precision, micro_batch_size=b.micro, checkpoint=ckpt,
                              offload=ckpt if acts.offload else "none",
                              offload_optimizer=offload_optimizer, max_grad_norm=clip,
                              optimizer_impl=optimizer_impl, remat=None, offload_params=None)


def _common_notes(plan: "Plan", notes: list[str]) -> None:
    if plan.knobs.remat:
        notes.append("remat (DTR) has no counterpart: the export leaves it out")
    if plan.knobs.offload_params not in (None, "none"):
        notes.append("offload_params (block weights on the host) has no counterpart here: the "
                     "export keeps the weights on the device (DeepSpeed ZeRO-3's offload_param "
                     "is the nearest)")


@dataclass(frozen=True)
class _Activations:
    blocks: int | None          # how many blocks the plan lists; None: none listed (policy only)
    recompute: tuple[int, ...]  # positions of the blocks to recompute, in execution order
    names: tuple[str, ...]      # their names
    every: int | None           # with no blocks listed: every:K policy's K, 1 for all, None: none
    offload: bool               # recomputed blocks keep their inputs on the host


def _activations(plan: "Plan", notes: list[str]) -> _Activations:
    """What to recompute, with selective made full and offload-only made recompute+offload."""
    modes = dict(plan.blocks)
    if not modes:
        return _from_policy(plan, notes)
    selective = [b for b, m in modes.items() if m.startswith("selective")]
    offload_only = [b for b, m in modes.items() if m == "offload"]
    if selective:
        notes.append(f"selective recompute ({_names(selective)}) has no counterpart: those blocks "
                     "are recomputed in full (less memory, more recompute time)")
    if offload_only:
        notes.append(f"offload without recompute ({_names(offload_only)}) has no counterpart: "
                     "those blocks are recomputed with their inputs on the host (no more device "
                     "memory than the plan, more recompute time)")
    chosen = [i for i, m in enumerate(modes.values()) if m in _RECOMPUTED or m == "offload"]
    names = tuple(list(modes)[i] for i in chosen)
    kept_here = [b for b in names if not modes[b].endswith("offload")]
    offload = len(kept_here) < len(names)
    if offload and kept_here:
        notes.append(f"offload applies to every recomputed block, also {_names(kept_here)}, "
                     "which the plan keeps on the device (less memory, slower)")
    return _Activations(len(modes), tuple(chosen), names, None, offload)


def _from_policy(plan: "Plan", notes: list[str]) -> _Activations:
    ckpt, off = plan.knobs.checkpoint, plan.knobs.offload
    policy = ckpt if ckpt not in (None, "none") else off if off not in (None, "none") else None
    if policy is None:
        return _Activations(None, (), (), None, False)
    every = int(policy[6:]) if isinstance(policy, str) and policy.startswith("every:") else 1
    if policy == "selective":
        notes.append("selective recompute has no counterpart: blocks are recomputed in full")
    notes.append(f"the plan lists no blocks (it was never applied to a model): exported from its "
                 f"policy {policy!r}" + (", every layer" if isinstance(policy, tuple) else ""))
    return _Activations(None, (), (), every, off not in (None, "none"))


def _names(names) -> str:
    names = list(names)
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, ... ({len(names)})"


# -- transformers TrainingArguments ------------------------------------------------------------------

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



def to_deepspeed_config(plan: "Plan", batch_size: int, world_size: int = 1) -> Export:
    """A DeepSpeed config with the ZeRO stage the plan maps to (``planner._export_deepspeed``)."""
    from memfit.planner._export_deepspeed import to_deepspeed_config as make
    return make(plan, batch_size, world_size)
