"""The DeepSpeed export: a config for ``deepspeed.initialize`` (or the HF Trainer's ``deepspeed=``)
with the ZeRO stage the plan maps to, and memfit's predicted bytes per rank for it.

Note 1 (activation checkpointing). The config section only configures
``deepspeed.checkpointing.checkpoint``: it recomputes nothing unless the model calls that
function around its blocks. Under the HF Trainer, checkpointing comes from TrainingArguments.

Note 2 (ZeRO stage). DeepSpeed's config reference ("Optimizer offloading",
https://www.deepspeed.ai/docs/config-json/) allows CPU ``offload_optimizer`` with ZeRO stages
1, 2 and 3. The export uses stage 2 (ZeRO-Offload as published, and the lowest stage Accelerate's
config wizard offers offload for): on one device it keeps what stage 1 keeps, less the gradients
already copied to the host. A torch optimizer needs ``zero_force_ds_cpu_optimizer: false``
(DeepSpeed otherwise demands its CPU Adam); ZeRO's own buckets are not in memfit's prediction.

Note 3 (bytes per rank). A plan made for several GPUs (``gpus=N``) maps to ZeRO-3 under FSDP2
(parameters, gradients and optimizer state partitioned, parameters gathered per layer: FSDP2's
``fully_shard``) and to stage 0 under DDP; its predicted device bytes are estimate_sharded's
re-trace of that layout, carried as ``per_rank_bytes[stage]`` (``api._sharded.zero_per_rank_bytes``
predicts stages 0-3 for one model and rank batch). Figures are memfit's own training step
(autocast over fp32 weights), not DeepSpeed's bf16-weights engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfit.planner._export_parts import (Export, _activations, _batching, _check_world, _clip,
                                    _common_notes, _exported, _names, _precision)

if TYPE_CHECKING:
    from memfit.planner.plan import Plan

__all__ = ["to_deepspeed_config"]


def to_deepspeed_config(plan: "Plan", batch_size: int, world_size: int = 1) -> Export:
    """A DeepSpeed config (``deepspeed.initialize(config=...)`` or the HF Trainer's ``deepspeed=``).

    ``train_batch_size`` is ``train_micro_batch_size_per_gpu * gradient_accumulation_steps *
    world_size``, as DeepSpeed requires."""
    _check_world(world_size)
    notes: list[str] = []
    b = _batching(plan, batch_size, "DeepSpeed", notes)
    precision = _precision(plan)
    config: dict = {"train_batch_size": b.micro * b.steps * world_size,
                    "train_micro_batch_size_per_gpu": b.micro,
                    "gradient_accumulation_steps": b.steps,
                    **_clip(plan, "gradient_clipping", "DeepSpeed", 1.0, notes)}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                          "loss_scale_window": 2000, "hysteresis": 1, "min_loss_scale": 1}
    elif precision in ("bf16", "bf16-pure"):
        config["bf16"] = {"enabled": True}
    if precision in ("fp16", "bf16"):
        notes.append(f"{precision}: DeepSpeed casts the model to {precision} and keeps fp32 master "
                     "weights; memfit planned autocast over fp32 weights, so "
                     "numerics and memory differ (newer DeepSpeed has a torch_autocast section)")
    zero: dict = {"stage": 0}
    per_rank = None
    if plan.knobs.sharding in ("fsdp", "ddp"):                  # Note 3
        stage = 3 if plan.knobs.sharding == "fsdp" else 0
        zero = {"stage": stage}
        if stage == 3:
            zero["stage3_prefetch_bucket_size"] = "auto"
        per_rank = {stage: plan.predicted_device_bytes}
        if world_size != (plan.knobs.gpus or world_size):
            notes.append(f"world_size={world_size} but the plan is for {plan.knobs.gpus} GPUs: "
                         "per_rank_bytes are the plan's")
        notes.append(f"ZeRO-{stage} is what the plan's {plan.knobs.sharding} layout maps to; "
                     "per_rank_bytes is memfit's re-trace of that layout "
                     "(_export_deepspeed Note 3)")
    elif plan.knobs.offload_optimizer:
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        config["zero_force_ds_cpu_optimizer"] = False
        notes.append("offload_optimizer: ZeRO-2 with CPU optimizer offload; "
                     "zero_force_ds_cpu_optimizer=false keeps your torch optimizer (stepped on the "
                     "host, as memfit's); ZeRO takes only optimizers it has tested (Adam, AdamW, "
                     "...) unless zero_allow_untested_optimizer is set, and steps flat partitions")
        notes.append("ZeRO's reduce/allgather buckets (reduce_bucket_size, "
                     "allgather_bucket_size) are not in memfit's prediction: lower them if the "
                     "budget is tight" + (f"; with {world_size} processes ZeRO-2 also partitions "
                     "optimizer state and gradients (less memory per device than predicted)"
                     if world_size > 1 else ""))
    config["zero_optimization"] = zero
    acts = _activations(plan, notes)
    if acts.recompute or acts.every is not None:
        config["activation_checkpointing"] = {
            "partition_activations": False, "cpu_checkpointing": acts.offload,
            "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
            "profile": False}
        which = _names(acts.names) if acts.names else "the plan's blocks"
        notes.append(f"activation_checkpointing recomputes only where the model calls "
                     f"deepspeed.checkpointing.checkpoint: wrap {which} with it; "
                     "under the HF Trainer use to_training_arguments's checkpointing instead")
    _common_notes(plan, notes)
    oo = bool(plan.knobs.offload_optimizer)
    cast = precision
    if precision in ("bf16", "bf16-pure"):          # DeepSpeed casts the model (Note 2)
        cast = "bf16" if oo else "bf16-pure"
        if oo:
            notes.append("predicted_device_bytes models DeepSpeed's bf16 as autocast bf16: "
                         "memfit cannot model bf16 weights with the optimizer on the host")
    return Export(config, tuple(notes), _exported(
        plan, b, acts, precision=cast, clip=config.get("gradient_clipping", 1.0) or None,
        offload_optimizer=oo, optimizer_impl=plan.knobs.optimizer_impl),
        per_rank_bytes=per_rank)
