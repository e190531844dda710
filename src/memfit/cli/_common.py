"""Model, batch and device flags shared by subcommands."""

from __future__ import annotations

import argparse

from memfit import zoo

DEFAULT_MODEL = "xlm-roberta-large"
DEFAULT_GPU = "gtx-1080-ti"


def add_model_args(p: argparse.ArgumentParser, batch_size: int = 8,
                   lever_auto: bool = False) -> None:
    """``lever_auto``: --batch-size and --seq-len also take 'auto' (the largest that fits)."""
    g = p.add_argument_group("model and batch")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, metavar="NAME",
                     help=f"a built-in model (default: {DEFAULT_MODEL}); list them with "
                          "`python -c 'import memfit.zoo as z; print(z.names())'`")
    src.add_argument("--config", default=None, metavar="PATH",
                     help="a Hugging Face config.json (or a folder holding one) instead of --model")
    g.add_argument("--task", default=None,
                   help="training head, e.g. sequence-classification, causal-lm, masked-lm "
                        "(default: the model's usual one)")
    auto = " or 'auto': the largest that fits the budget" if lever_auto else ""
    number = _int_or_auto if lever_auto else int
    g.add_argument("--batch-size", type=number, default=batch_size,
                   help=f"samples per step (default: {batch_size}){auto}")
    g.add_argument("--seq-len", "--max-seq-len", dest="seq_len", type=number, default=None,
                   help=f"tokens per sample for text models (default: 256){auto}")
    g.add_argument("--image-size", type=int, default=None,
                   help="image side in pixels for vision models (default: the model's, e.g. 224)")
    g.add_argument("--padded", action="store_true",
                   help="rows of varying length with right padding instead of full rows")


def _int_or_auto(text: str):
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or 'auto'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def build_model(args):
    """The model spec and the model on the meta device (no memory)."""
    spec = zoo.from_config_file(args.config, task=args.task) if args.config else \
        zoo.get(args.model or DEFAULT_MODEL)
    return spec, spec.build(args.task, device="meta")


def make_batch(spec, model, args, batch_size: int, seq_len: int | None):
    return spec.make_batch(model, batch_size, seq_len=seq_len, image_size=args.image_size,
                           padded=args.padded, task=args.task)


def build_model_and_batch(args):
    """The model on the meta device (no memory) and a real batch for it."""
    spec, model = build_model(args)
    return spec, model, make_batch(spec, model, args, args.batch_size, args.seq_len)
