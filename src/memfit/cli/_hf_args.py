"""``--hf-args FILE.json``: the estimate or plan of a Hugging Face ``Trainer`` run, from its
``TrainingArguments`` as people keep them (a JSON object of their keywords).

Note 1 (the run). The model is built as ``--model`` / ``--config`` say, on the ``meta`` device;
the Trainer over it gets the JSON's arguments (``place_model_on_device`` off, as transformers
documents it, by a subclass: a meta model has nothing to move) and a generated dataset of the zoo's batches at ``--seq-len``, enough samples
for one optimizer step and the batch the dataloader reads ahead, collated by transformers'
``default_data_collator`` from plain lists, as a tokenized dataset's rows are. The batch size, accumulation, precision, checkpointing, optimizer
(``optim``), scheduler and clipping are the JSON's: memfit's own flags for those are refused.
``memfit.integrations.transformers`` then traces (estimate) or plans and applies (plan) that run.

Note 2 (export). ``plan --hf-args F --export transformers`` writes the arguments with the plan's
changes applied to a new file beside F (``F.memfit.json``; the user's file is never
overwritten). Per-block hooks and memfit's optimizer offload have no TrainingArguments keyword:
the output says so, and ``memfit.integrations.transformers.fit(trainer, budget)`` applies them.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["add_hf_args_arg", "check_hf_args", "hf_trainer", "export_path"]

# memfit flags whose setting is the JSON's under --hf-args (Note 1), with its keyword
_OWNED = {"precision": "bf16 / fp16", "batch_size": "per_device_train_batch_size",
          "micro_batch_size": "per_device_train_batch_size and gradient_accumulation_steps",
          "checkpoint": "gradient_checkpointing", "max_grad_norm": "max_grad_norm",
          "optimizer": "optim", "optimizer_impl": "optim", "zero_grad": None}

# those a namespace built without the parser (no ``given``) can be checked by their value for
_VALUED = ("precision", "micro_batch_size", "checkpoint", "max_grad_norm", "optimizer_impl",
           "zero_grad")


def add_hf_args_arg(g) -> None:
    g.add_argument("--hf-args", default=None, metavar="FILE.json",
                   help="a Hugging Face TrainingArguments JSON: the estimate/plan of that "
                        "Trainer run on --model/--config (its batch size, accumulation, bf16, "
                        "gradient_checkpointing, optim, max_grad_norm are the file's)")


def check_hf_args(args, precision_default=None) -> dict | None:
    """The JSON's keywords, read and checked before any tracing; None without --hf-args."""
    path = getattr(args, "hf_args", None)
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--hf-args {path}: no such file; pass the path of a JSON object of "
                         "TrainingArguments keywords (e.g. saved with args.to_json_string())")
    try:
        values = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-args {path} is not valid JSON: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"--hf-args {path} holds a JSON {type(values).__name__}, not an object "
                         "of TrainingArguments keywords")
    import dataclasses

    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--hf-args {path}: {unknown} are not TrainingArguments keywords of "
                         "the installed transformers")
    for knob, keyword in _OWNED.items():
        if _typed(args, knob, precision_default):
            flag = "--" + knob.replace("_", "-")
            where = f"set {keyword} in the JSON" if keyword else "the Trainer's loop is its own"
            raise ValueError(f"{flag} with --hf-args: the Trainer run is the file's; {where}")
    return values


def _typed(args, knob: str, precision_default) -> bool:
    """Whether the user set ``knob``: typed on the command line (``cli._args.given_dests``), or, for
    a namespace built without the parser, a value that is not a default."""
    typed = getattr(args, "given", None)
    if typed is not None:
        return knob in typed
    return knob in _VALUED and getattr(args, knob, None) not in (None, "auto", precision_default)


def hf_trainer(spec, model, args, values: dict, samples: int | None = None):
    """The Trainer of Note 1 over ``model`` (on the meta device); ``samples``: how many to
    generate (default: one optimizer step's and the look-ahead batch, all a trace reads)."""
    import tempfile

    from transformers import Trainer, TrainingArguments, default_data_collator

    from memfit.cli._adapt import base_model

    class MetaModelArguments(TrainingArguments):     # the documented way to keep a model
        @property                                    # where it is (here: on the meta device)
        def place_model_on_device(self) -> bool:
            return False

    import torch

    values = {"output_dir": tempfile.mkdtemp(prefix="memfit-hf-"), "report_to": "none", **values}
    if not torch.cuda.is_available():     # the trace runs on this CPU whatever the target
        if values.get("fp16"):
            raise ValueError("--hf-args with fp16: transformers runs fp16 only on a GPU, so "
                             "without CUDA here its step cannot be traced as the Trainer runs "
                             "it; use bf16 in the JSON, or run memfit where CUDA is")
        values["use_cpu"] = True
    training = MetaModelArguments(**values)
    n = samples or training.per_device_train_batch_size * (
        training.gradient_accumulation_steps + 1)
    batch = spec.make_batch(base_model(model), n, seq_len=args.seq_len,
                            image_size=getattr(args, "image_size", None),
                            padded=getattr(args, "padded", False), task=args.task)
    samples = [{k: v[i].tolist() for k, v in batch.items()} for i in range(n)]   # as rows
    #   of a tokenized dataset are (and no view keeps the whole generated batch alive)
    return Trainer(model=model, args=training, train_dataset=samples,
                   data_collator=default_data_collator)


def export_path(path: str) -> Path:
    p = Path(path)
    return p.with_name(p.stem + ".memfit.json")
