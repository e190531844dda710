"""The refusals the CLI's flags alone decide, before torch is imported or a model built.

``check_flags`` runs in ``estimate``'s and ``plan``'s first checks (a refusal in under a
second), and again where ``cli._common.adapted`` applies the flags to a model (whose
``--quantize`` branch relies on it).
"""

from __future__ import annotations

__all__ = ["check_flags"]


def check_flags(args) -> None:
    """What the flags alone refuse, before torch is imported or a model built: the attention
    kernel's precision, --packing's companions, LoRA's and --quantize's, a low-bit optimizer
    state's optimizer."""
    _check_attention(args)
    if getattr(args, "packing", False):
        _check_packing_flags(args)
    lora, targets = getattr(args, "lora_rank", None), getattr(args, "lora_targets", None)
    if targets is not None and not lora:
        raise ValueError("--lora-targets names the layers LoRA adapts: give --lora-rank R too")
    if targets is not None and not [t for t in targets.split(",") if t.strip()]:
        raise ValueError(f"--lora-targets {targets!r}: give module names, comma-separated "
                         "(q_proj,v_proj)")
    quantize = getattr(args, "quantize", None)
    if quantize and not lora and not getattr(args, "freeze", None):
        raise ValueError(f"--quantize {quantize} holds frozen weights in fewer bits: add "
                         "--lora-rank R (QLoRA) or --freeze PATTERN for the layers that do not "
                         "train")
    state = getattr(args, "optimizer_state", None)
    if state not in (None, "fp32") and getattr(args, "optimizer", "adamw") not in _LOW_BIT_NAMES:
        raise ValueError(f"--optimizer-state {state}: there are low-bit versions of Adam and "
                         f"AdamW only (techniques.low_bit_optimizer), not of "
                         f"{args.optimizer}: give --optimizer adamw (or adam), or leave "
                         "--optimizer-state unset")


# the --optimizer names whose class has low-bit states (low_bit_optimizer.LOW_BIT_CLASSES' keys)
_LOW_BIT_NAMES = ("adam", "adamw")


def _check_attention(args) -> None:
    """flash-attn 2 runs fp16/bf16 only: an fp32 step (estimate's default; plan's plain step
    under auto) would be refused after a trace, so it is refused now."""
    if getattr(args, "attn_implementation", None) == "flash_attention_2" and \
            getattr(args, "precision", None) in (None, "fp32", "auto"):
        raise ValueError("--attn-implementation flash_attention_2 runs in fp16 or bf16 only: "
                         "give --precision bf16 (or fp16, bf16-pure); under auto memfit also "
                         "traces the fp32 step as written, which flash-attn cannot run")


def _check_packing_flags(args) -> None:
    """--packing's refusals the flags alone decide."""
    if args.padded:
        raise ValueError("--packing removes the padding: give --packing or --padded, not both")
    for flag in ("batch_size", "seq_len"):
        if getattr(args, flag, None) == "auto":
            raise ValueError(f"--{flag.replace('_', '-')} auto is not searched with --packing "
                             "yet: give the sequences (--batch-size) and their tokens (--seq-len)")
    if getattr(args, "hf_args", None):
        raise ValueError("--packing describes memfit's own batch; with --hf-args the Trainer's "
                         "collator makes it: drop one of them")
