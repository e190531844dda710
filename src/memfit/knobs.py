"""``Knobs``: the choices memfit can make for a training step (one dataclass for every front).

A keyword fixes a choice, ``None`` leaves it to memfit, and "off" is always explicit
("none", ``False``). An unknown keyword is an error that names the valid ones.

Note 1 (knobs by concern). ``Knobs`` stays one flat frozen dataclass (every front and
``dataclasses.fields(Knobs)`` read it so); its fields fall into seven concerns, each readable
as one value: ``precision``, ``quantize_base`` and ``remat`` are single fields, and four groups
are frozen dataclasses of the same fields, with the same defaults and checks: ``k.batching``
(``Batching``: micro_batch_size, zero_grad, max_grad_norm, chunked_loss), ``k.block_policy``
(``BlockPolicy``: checkpoint, offload, offload_params, activation_memory_budget),
``k.optimizer_setup``
(``OptimizerSetup``: offload_optimizer, optimizer_impl, optimizer_state,
optimizer_in_backward, offload_gradients) and ``k.parallel``
(``ParallelLayout``: gpus, sharding, reshard_after_forward, fsdp_offload, mp_policy).
``Knobs.from_groups(precision=, batching=, block_policy=, optimizer_setup=, parallel=,
remat=, quantize_base=)`` builds one from them, and ``expand_groups`` turns group keywords among flat ones
into flat ones (what ``memfit.estimate(job, batching=Batching(...))`` does); a field given
both ways is an error. The groups are views: a Knobs holds only its flat fields.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from memfit._knob_combinations import check_combinations

__all__ = ["Knobs", "PRECISIONS", "OPTIMIZER_IMPLS", "ZERO_GRADS", "SHARDINGS", "OPTIMIZER_STATES",
           "NOT_YET", "Batching", "BlockPolicy", "OptimizerSetup", "ParallelLayout", "GROUPS",
           "expand_groups"]

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure", "auto")
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop", "compiled")
ZERO_GRADS = ("before-forward", "after-forward", "keep-buffers")
SHARDINGS = ("none", "ddp", "fsdp")
MP_POLICIES = ("bf16",)
OPTIMIZER_STATES = ("fp32", "bf16", "8bit", "4bit")
QUANTIZE_KINDS = ("none", "nf4", "fp4", "int8")    # techniques.quantized_base.KINDS, and off
_POLICY = re.compile(r"^(none|all|selective|every:[1-9][0-9]*)$")

# Knobs this version accepts but cannot apply yet, with the issue that brings them.
NOT_YET: dict[str, str] = {}
# per knob, the values that mean "off" beside None / False / "none"
_OFF = {"gpus": (1,), "optimizer_state": ("fp32",), "chunked_loss": (0,)}


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value is not None and value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)} "
                         "(or None: memfit decides)")


def _check_policy(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, str):
        selective = "'selective', " if name == "checkpoint" else ""
        if not _POLICY.match(value) or (value == "selective" and not selective):
            raise ValueError(f"{name}={value!r}: use 'none', 'all', 'every:K' (K >= 1), "
                             f"{selective}or a tuple of block names"
                             + (" ('selective' recomputes chosen ops: a checkpoint policy)"
                                if value == "selective" else ""))
    elif not (isinstance(value, tuple) and all(isinstance(v, str) for v in value)):
        raise ValueError(f"{name} must be a policy string or a tuple of block names, "
                         f"got {type(value).__name__}")


@dataclass(frozen=True)
class Knobs:
    """Every choice memfit can make; ``None`` means "memfit decides".

    precision: "fp32" (the user's numerics; the API's default), "fp16" (autocast + GradScaler),
        "bf16" (autocast), "bf16-pure" (bf16 weights, fp32 master weights held for the
        optimizer), or "auto" (memfit may pick; the CLI's default).
    micro_batch_size: samples per forward/backward; the effective batch is accumulated.
    checkpoint: recompute policy per block: "none", "all", "every:K", "selective" or a tuple of
        block names.
    offload: the same shapes but "selective", for saving activations to host memory.
    offload_optimizer: keep optimizer states in host memory.
    offload_params: the same shapes as ``checkpoint`` but "selective", for keeping chosen
        blocks' weights in host memory, fetched before each block's forward and backward
        (needs ``offload_optimizer``: the host copy is the optimizer's).
    remat: dynamic tensor rematerialization (DTR).
    max_grad_norm: clip the global gradient norm to this (after unscaling), per effective batch.
    optimizer_impl: how the torch optimizer steps: "foreach" (one kernel per op over all
        parameters: parameter-sized temporaries; CUDA's default), "fused" (one kernel per
        parameter group, no parameter-sized temporaries; Adam, AdamW, SGD, Adagrad), or
        "for-loop" (one parameter at a time, ``foreach=False``; the CPU's default), or
        "compiled" (the step under torch.compile, as ``opt.step = torch.compile(opt.step)``:
        each update fused, no parameter-sized temporaries; techniques.compiled_optimizer).
        ``None``: an optimizer instance keeps its own; for a name or factory memfit decides.
    zero_grad: the loop style of memfit's own step (without ``step=fn``): "before-forward"
        (``optimizer.zero_grad()`` first: last step's gradients are freed before the forward;
        ``None`` means this), "after-forward" (``zero_grad()`` after the forward, before
        backward: last step's gradients stay alive through the forward), or "keep-buffers"
        (``zero_grad(set_to_none=False)``: gradient buffers stay allocated all the time).
        With ``step=fn`` the step decides and this must be left unset.
    optimizer_state: the dtype of the optimizer's state: "fp32" (torch's), "bf16", "8bit" or
        "4bit" (low-bit optimizers; they change the numerics).
    gpus: data-parallel ranks (an int >= 1) or "auto" (the fewest that fit).
    sharding: "none", "ddp" (replicated, gradient buckets) or "fsdp" (FSDP2 ``fully_shard``).
    reshard_after_forward: FSDP2's: free the unsharded parameters after a block's forward
        (True), keep them to the backward (False), or reshard to a group of this many ranks.
    fsdp_offload: FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer
        state on the host.
    mp_policy: FSDP2's ``MixedPrecisionPolicy``: "bf16" (bf16 unsharded parameters and
        compute, fp32 sharded parameters and gradient reduction; with precision "fp32", no
        autocast) or None (none).
    chunked_loss: a causal LM's loss computed over this many pieces of the tokens, each
        piece's logits made from the head, upcast and recomputed in backward one piece at a
        time, so the (tokens x vocab) logits never exist whole (``techniques.chunked_loss``);
        0: the model's own loss (off).
    quantize_base: hold the frozen linear weights in 4 or 8 bits with bitsandbytes, as QLoRA
        and LLM.int8 load a base model: "nf4" (with double quantization, bf16 compute), "fp4"
        or "int8" (``techniques.quantized_base``); "none" or None: as they are. Changes the
        numerics; applied to the model in place when a plan is run.
    optimizer_in_backward: step each parameter, and free its gradient, as soon as backward
        has accumulated it (one optimizer per parameter, run by a post-accumulate-grad hook,
        as torchtune does; ``techniques.optimizer_in_backward``): the whole set of gradients
        never exists. Same numerics; refused with accumulation, clipping, fp16 and several GPUs.
    offload_gradients: with ``offload_optimizer``, copy each gradient to the optimizer's host
        copy as backward produces it and free it on the device (torchao's
        ``CPUOffloadOptimizer(offload_gradients=True)``): the gradients never accumulate on the
        device; micro-batches accumulate on the host. Same numerics; refused with fp16 and
        ``step=fn`` (their GradScaler or clipping read the device gradients).
    activation_memory_budget: for a ``torch.compile``d model, the partitioner's
        ``torch._functorch.config.activation_memory_budget`` (0 to 1: the share of the
        activations forward keeps, the rest recomputed in backward; 1 is torch's default),
        set while the model compiles (``trace.compiled``); refused for an eager model.
    """

    precision: str | None = None
    micro_batch_size: int | None = None
    checkpoint: str | tuple[str, ...] | None = None
    offload: str | tuple[str, ...] | None = None
    offload_optimizer: bool | None = None
    remat: bool | None = None
    max_grad_norm: float | None = None
    optimizer_impl: str | None = None
    zero_grad: str | None = None
    optimizer_state: str | None = None
    gpus: int | str | None = None
    sharding: str | None = None
    reshard_after_forward: bool | int | None = None
    fsdp_offload: bool | None = None
    offload_params: str | tuple[str, ...] | None = None
    mp_policy: str | None = None
    chunked_loss: int | None = None
    quantize_base: str | None = None
    optimizer_in_backward: bool | None = None
    offload_gradients: bool | None = None
    activation_memory_budget: float | None = None

    def __post_init__(self):
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        mbs = self.micro_batch_size
        if mbs is not None and (isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1):
            raise ValueError(f"micro_batch_size must be a positive int, got {mbs!r}")
        if self.optimizer_impl is not None and self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ValueError(f"optimizer_impl={self.optimizer_impl!r} is not one of "
                             f"{', '.join(OPTIMIZER_IMPLS)} (or None: memfit decides)")
        if self.zero_grad is not None and self.zero_grad not in ZERO_GRADS:
            raise ValueError(f"zero_grad={self.zero_grad!r} is not one of {', '.join(ZERO_GRADS)} "
                             "(or None: before-forward, memfit's default)")
        _check_choice("optimizer_state", self.optimizer_state, OPTIMIZER_STATES)
        _check_choice("quantize_base", self.quantize_base, QUANTIZE_KINDS)
        _check_choice("sharding", self.sharding, SHARDINGS)
        _check_choice("mp_policy", self.mp_policy, MP_POLICIES)
        g = self.gpus
        if g is not None and g != "auto" and (isinstance(g, bool) or not isinstance(g, int)
                                              or g < 1):
            raise ValueError(f"gpus must be an int >= 1 or 'auto', got {g!r}")
        r = self.reshard_after_forward
        if r is not None and not isinstance(r, bool) and (not isinstance(r, int) or r < 2):
            raise ValueError(f"reshard_after_forward must be True, False or a group size >= 2, "
                             f"got {r!r}")
        for name in ("checkpoint", "offload", "offload_params"):
            value = getattr(self, name)
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                object.__setattr__(self, name, tuple(value))   # a plan's --json gives a list
            _check_policy(name, getattr(self, name))
        for name in ("offload_optimizer", "remat", "fsdp_offload", "optimizer_in_backward",
                     "offload_gradients"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        c = self.chunked_loss
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"chunked_loss must be a number of pieces (an int >= 1), 0 for the "
                             f"model's own loss, or None (memfit decides); got {c!r}")
        g = self.max_grad_norm
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not g > 0):
            raise ValueError(f"max_grad_norm must be a positive number, got {g!r}")
        a = self.activation_memory_budget
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, float)) or
                              not 0.0 <= a <= 1.0):
            raise ValueError(f"activation_memory_budget must be a number from 0 to 1 (the share "
                             f"of the activations a compiled forward keeps), got {a!r}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "Knobs":
        """Build from keyword arguments; an unknown keyword names the valid ones."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            groups = [n for n in unknown if n in GROUPS]
            hint = f" ({', '.join(groups)}: a group of knobs, which Knobs.from_groups and the " \
                "Job forms memfit.estimate(job, ...), plan and fit take)" if groups else ""
            raise TypeError(f"unknown knob(s) {', '.join(unknown)}; valid knobs: "
                            f"{', '.join(names)}{hint}")
        return cls(**kwargs)

    def replace(self, **changes) -> "Knobs":
        return dataclasses.replace(self, **changes)

    def check_available(self) -> None:
        """Refuse knobs this version cannot apply yet (set to anything but off)."""
        for name, what in NOT_YET.items():
            v = getattr(self, name)
            if v not in (None, False, "none") + _OFF.get(name, ()):
                raise ValueError(f"{name}={v!r} needs {what}, which this version of memfit does "
                                 f"not have yet; leave {name} unset")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check_combinations(self, user_step: bool = False) -> None:
        """Refuse, with the fix, the combinations no technique runs yet (``_knob_combinations``:
        knobs alone, no torch); ``user_step``: the loop is the caller's (``step=fn``)."""
        check_combinations(self, user_step)

    # the knobs by concern (Note 1): read-only views of the flat fields
    @property
    def batching(self) -> "Batching":
        return self._group(Batching)

    @property
    def block_policy(self) -> "BlockPolicy":
        return self._group(BlockPolicy)

    @property
    def optimizer_setup(self) -> "OptimizerSetup":
        return self._group(OptimizerSetup)

    @property
    def parallel(self) -> "ParallelLayout":
        return self._group(ParallelLayout)

    def _group(self, cls: type):
        return cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)})

    def groups(self) -> dict:
        """The knobs by concern (Note 1): precision, batching, block_policy, optimizer_setup,
        parallel, remat, quantize_base."""
        return {"precision": self.precision, **{n: getattr(self, n) for n in GROUPS},
                "remat": self.remat, "quantize_base": self.quantize_base}

    @classmethod
    def from_groups(cls, *, precision: str | None = None, batching: "Batching | None" = None,
                    block_policy: "BlockPolicy | None" = None,
                    optimizer_setup: "OptimizerSetup | None" = None,
                    parallel: "ParallelLayout | None" = None,
                    remat: bool | None = None, quantize_base: str | None = None) -> "Knobs":
        """A Knobs from its concerns (Note 1); a group left None leaves its knobs unset."""
        return cls(**expand_groups(dict(precision=precision, remat=remat,
                                        quantize_base=quantize_base, batching=batching,
                                        block_policy=block_policy,
                                        optimizer_setup=optimizer_setup, parallel=parallel)))


class _Group:
    """A group of knobs (Note 1): checked as ``Knobs`` checks its fields, on construction."""

    def __post_init__(self):
        Knobs(**self.to_dict())

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class Batching(_Group):
    """How one effective batch is stepped: ``micro_batch_size``, ``zero_grad`` (the loop
    style), ``max_grad_norm``, ``chunked_loss`` (how the loss is taken; as ``Knobs`` documents
    them)."""

    micro_batch_size: int | None = None
    zero_grad: str | None = None
    max_grad_norm: float | None = None
    chunked_loss: int | None = None


@dataclass(frozen=True)
class BlockPolicy(_Group):
    """What each block does with what it saves and holds: ``checkpoint`` (recompute),
    ``offload`` (saved activations to host), ``offload_params`` (its weights on the host),
    and for a compiled model torch.compile's own ``activation_memory_budget``."""

    checkpoint: str | tuple[str, ...] | None = None
    offload: str | tuple[str, ...] | None = None
    offload_params: str | tuple[str, ...] | None = None
    activation_memory_budget: float | None = None


@dataclass(frozen=True)
class OptimizerSetup(_Group):
    """Where and how the optimizer steps: ``offload_optimizer`` (its state on the host),
    ``optimizer_impl`` (foreach, fused, for-loop), ``optimizer_state`` (its state's dtype),
    ``optimizer_in_backward`` (each parameter stepped in backward), ``offload_gradients``
    (gradients to the host as backward produces them)."""

    offload_optimizer: bool | None = None
    optimizer_impl: str | None = None
    optimizer_state: str | None = None
    optimizer_in_backward: bool | None = None
    offload_gradients: bool | None = None


@dataclass(frozen=True)
class ParallelLayout(_Group):
    """The data-parallel layout: ``gpus``, ``sharding``, and FSDP2's
    ``reshard_after_forward``, ``fsdp_offload``, ``mp_policy``."""

    gpus: int | str | None = None
    sharding: str | None = None
    reshard_after_forward: bool | int | None = None
    fsdp_offload: bool | None = None
    mp_policy: str | None = None


# group keyword -> its class (Note 1)
GROUPS: dict[str, type] = {"batching": Batching, "block_policy": BlockPolicy,
                           "optimizer_setup": OptimizerSetup, "parallel": ParallelLayout}


def expand_groups(kwargs: dict) -> dict:
    """``kwargs`` with each group keyword (Note 1) replaced by its fields that are set; a
    group of the wrong class, or a field given both flat and in a group, is refused."""
    out = {n: v for n, v in kwargs.items() if n not in GROUPS}
    for name, cls in GROUPS.items():
        group = kwargs.get(name)
        if group is None:
            continue
        if not isinstance(group, cls):
            raise TypeError(f"{name} must be a memfit.knobs.{cls.__name__}, got "
                            f"{type(group).__name__}")
        for field, value in group.to_dict().items():
            if value is None:
                continue
            if out.get(field) is not None:
                raise ValueError(f"{field} is given twice: as {field}={out[field]!r} and in "
                                 f"{name}={group!r}; give it once")
            out[field] = value
    return out
