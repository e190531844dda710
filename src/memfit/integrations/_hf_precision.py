"""The Trainer at another precision: ``fit(trainer, budget, precision=...)`` (by default fit keeps
the arguments' own).

Note 1 (why the accelerator is rebuilt). ``TrainingArguments`` turn ``bf16``/``fp16`` into
``mixed_precision`` when they are made, and the Trainer's accelerator reads it once, when the
Trainer is built: it is the accelerator that wraps the model's forward in autocast (and, for
fp16, scales the loss). Setting ``args.bf16`` afterwards changes nothing, so a trace or a run
at another precision needs an accelerator built at it. accelerate keeps one process-wide
``AcceleratorState`` and refuses another mixed precision while it is set; transformers itself
clears it whenever a ``TrainingArguments`` sets up its devices
(``AcceleratorState._reset_state(reset_partial_state=True)``, ``TrainingArguments._setup_devices``),
and so does ``rebuild`` here before ``trainer.create_accelerator_and_postprocess()``. The
trainer's accelerator object, its ``gather_function`` and its flags are put back afterwards
(``at_precision``), with the shared state rebuilt at the user's precision again. A ``train()``
at the new precision wraps the model's ``forward`` in autocast in place (accelerate's
``prepare_model``); undoing the change unwraps it (``unwrap_autocast``: accelerate's
``extract_model_from_parallel(keep_fp32_wrapper=False)``, then the class's own ``forward``).

Note 2 (which precision). None: the arguments' own (the default: fit never changes numerics unless
asked). "auto": the 16-bit one the target device has (bf16, else fp16 on a GPU; none on a CPU:
``api._setup.resolve_precision``), weighed beside the user's own like ``memfit.plan``'s "auto" (the
plain step at the user's precision is traced beside it). "bf16" / "fp16": that one (bf16 checked
against the device).
"""

from __future__ import annotations

import contextlib
import copy

from memfit.api._setup import resolve_precision

__all__ = ["set_precision", "rebuild", "at_precision", "precisions_for", "user_precision",
           "unwrap_autocast"]

_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def user_precision(args) -> str:
    """The precision the TrainingArguments run: "bf16", "fp16" or "fp32"."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def set_precision(args, precision: str):
    """``args`` (in place) at ``precision``, as ``TrainingArguments.__post_init__`` sets it."""
    args.bf16, args.fp16 = precision == "bf16", precision == "fp16"
    args.mixed_precision = _MIXED[precision]
    return args


def rebuild(trainer) -> None:
    """A fresh accelerator for ``trainer.args`` (Note 1)."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    trainer.create_accelerator_and_postprocess()


_KEPT = ("accelerator", "gather_function", "is_deepspeed_enabled", "is_fsdp_enabled")


@contextlib.contextmanager
def at_precision(trainer, precision: str):
    """The trainer at ``precision`` (arguments and accelerator) for one trace; put back after
    (Note 1). At its own precision nothing is touched."""
    if precision == user_precision(trainer.args):
        yield trainer
        return
    saved_args = trainer.args
    saved = {k: getattr(trainer, k) for k in _KEPT}
    trainer.args = set_precision(copy.copy(saved_args), precision)
    try:
        rebuild(trainer)
        yield trainer
    finally:
        trainer.args = saved_args
        rebuild(trainer)               # the shared state at the user's precision again
        for k, v in saved.items():
            setattr(trainer, k, v)


def precisions_for(precision: str | None, args, spec) -> list[str]:
    """The precisions fit weighs (Note 2), the user's own first where it is one of them."""
    user = user_precision(args)
    if precision is None:
        return [user]
    if precision not in ("auto", "bf16", "fp16"):
        raise ValueError(f"precision={precision!r}: give None (the TrainingArguments' own), "
                         "'auto' (the 16-bit precision the device has, weighed beside yours), "
                         "'bf16' or 'fp16'")
    if precision == "auto":
        other = resolve_precision("auto", spec)
        return [user] if other == user or user != "fp32" else [user, other]
    return [resolve_precision(precision, spec)]


def unwrap_autocast(model) -> None:
    """The autocast a ``train()`` wrapped ``model.forward`` in, taken off (Note 1)."""
    from accelerate.utils import extract_model_from_parallel
    if "_original_forward" not in vars(model):
        return
    extract_model_from_parallel(model, keep_fp32_wrapper=False)
    own = vars(model).get("forward")
    if getattr(own, "__func__", None) is type(model).forward:
        del model.forward
