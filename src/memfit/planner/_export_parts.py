"""What every export target needs (``planner.exports``, ``planner._export_deepspeed``): the
``Export`` a plan becomes, and the plan read in a target's terms (batching, precision,
clipping, activations), with the knobs memfit predicts the exported run with.

Note 1 (micro-batches). memfit cuts a batch into chunks of ``micro_batch_size`` and a smaller
last chunk (``Accumulation.split``); the targets run ``steps`` equal micro-batches. With
``steps = ceil(batch / micro)`` the micro-batch, hence the memory, is the plan's, but the
effective batch becomes ``micro * steps``; the note names the largest divisor of the batch not
above the plan's micro-batch, which keeps the batch and needs no more memory per micro-batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.knobs import Knobs
from memfit.modes import Mode

if TYPE_CHECKING:
    from memfit.planner.plan import Plan


@dataclass(frozen=True)
class Export:
    """A plan in a target's terms: ``config`` (JSON-able, the target's key names) and ``notes``
    (what does not map, and what the config does instead)."""

    config: dict
    notes: tuple[str, ...] = ()
    knobs: "Knobs | None" = None          # memfit's knobs for what the export runs
    predicted_device_bytes: int | None = None   # those knobs re-traced (export_traced)
    # DeepSpeed: ZeRO stage -> memfit's predicted bytes per rank (its re-trace of the layout)
    per_rank_bytes: dict | None = None

    def to_json(self) -> str:
        """The config alone (JSON has no comments: read ``notes`` beside it)."""
        return json.dumps(self.config, indent=2)

    def to_yaml(self) -> str:
        """The config as YAML, the notes as comments above it (Accelerate's format)."""
        import yaml   # PyYAML: a dependency of transformers, needed only here

        head = "".join(f"# {n}\n" for n in self.notes)
        return head + yaml.safe_dump(self.config, sort_keys=False)


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
    # no export maps memfit's block-weight offload nor its gradients moved to the host in
    # backward (_common_notes): the weights and the gradients stay on the device
    return plan.knobs.replace(precision=precision, micro_batch_size=b.micro, checkpoint=ckpt,
                              offload=ckpt if acts.offload else "none",
                              offload_optimizer=offload_optimizer, max_grad_norm=clip,
                              optimizer_impl=optimizer_impl, remat=None, offload_params=None,
                              chunked_loss=None, optimizer_in_backward=None,
                              offload_gradients=None)


def _common_notes(plan: "Plan", notes: list[str]) -> None:
    if plan.knobs.remat:
        notes.append("remat (DTR) has no counterpart: the export leaves it out")
    if plan.knobs.optimizer_in_backward:
        notes.append("optimizer_in_backward (the optimizer stepped in backward) has no "
                     "counterpart here: the export steps it after backward (torchtune's "
                     "optimizer_in_bwd=True is the nearest), so the gradients all exist at once")
    if getattr(plan.knobs, "offload_gradients", None):
        notes.append("offload_gradients (each gradient to the host as backward makes it) has no "
                     "counterpart here: the export keeps the gradients on the device until the "
                     "step (torchao's CPUOffloadOptimizer(offload_gradients=True) is the nearest, "
                     "without accumulation)")
    if plan.knobs.chunked_loss:
        notes.append("chunked_loss (the loss in pieces) has no counterpart here: the export "
                     "keeps the model's own loss (Liger's fused linear cross-entropy, "
                     "use_liger_kernel, is the nearest)")
    q = getattr(plan.knobs, "quantize_base", None)
    if q not in (None, "none"):
        how = "load_in_8bit=True" if q == "int8" else \
            f"load_in_4bit=True, bnb_4bit_quant_type='{q}', bnb_4bit_use_double_quant=True, " \
            "bnb_4bit_compute_dtype=torch.bfloat16"
        notes.append(f"quantize_base={q!r}: these arguments do not quantize; load the model "
                     f"with transformers' BitsAndBytesConfig({how}) as quantization_config, "
                     "then add LoRA with peft (memfit.fit quantizes it in place)")
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
    selective = [b for b, m in modes.items() if m in (Mode.SELECTIVE, Mode.SELECTIVE_OFFLOAD)]
    offload_only = [b for b, m in modes.items() if m == Mode.OFFLOAD]
    if selective:
        notes.append(f"selective recompute ({_names(selective)}) has no counterpart: those blocks "
                     "are recomputed in full (less memory, more recompute time)")
    if offload_only:
        notes.append(f"offload without recompute ({_names(offload_only)}) has no counterpart: "
                     "those blocks are recomputed with their inputs on the host (no more device "
                     "memory than the plan, more recompute time)")
    chosen = [i for i, m in enumerate(modes.values()) if m.recomputes or m.offloads]
    names = tuple(list(modes)[i] for i in chosen)
    kept_here = [b for b in names if not modes[b].offloads]
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
