"""Model, batch and device flags shared by subcommands."""

from __future__ import annotations

import argparse

from memfit import zoo

DEFAULT_MODEL = "xlm-roberta-large"
DEFAULT_GPU = "gtx-1080-ti"


def add_model_args(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--batch-size", type=int, default=8, help="samples per step (default: 8)")
    g.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample for text models (default: 256)")
    g.add_argument("--image-size", type=int, default=None,
                   help="image side in pixels for vision models (default: the model's, e.g. 224)")
    g.add_argument("--padded", action="store_true",
                   help="rows of varying length with right padding instead of full rows")


def build_model_and_batch(args):
    """The model on the meta device (no memory) and a real batch for it."""
    spec = zoo.from_config_file(args.config, task=args.task) if args.config else \
        zoo.get(args.model or DEFAULT_MODEL)
    model = spec.build(args.task, device="meta")
    batch = spec.make_batch(model, args.batch_size, seq_len=args.seq_len,
                            image_size=args.image_size, padded=args.padded, task=args.task)
    return spec, model, batch
