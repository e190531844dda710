"""Model, batch, device and budget flags shared by subcommands, and their checks before tracing.

Nothing here imports torch at import time: ``memfit --help`` stays fast. ``check_model_arg``
(the model's name or config file, the task) and ``resolve_target`` (the GPU, the budget) check
what needs no trace without importing torch or transformers either, so bad input is refused
in under a second, not after seconds of imports and a trace.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from memfit.cli._args import (BYTES_HELP, budget_bytes, check_output_path, cuda_version,
                              int_or_auto, positive_int, reserve_bytes)
from memfit.knobs import OPTIMIZER_IMPLS

__all__ = ["DEFAULT_MODEL", "DEFAULT_GPU", "OPTIMIZER_NAMES", "add_model_args",
           "add_target_args", "add_optimizer_impl_arg", "optimizer_impl_knob", "Target",
           "resolve_target", "resolve_device", "check_paths", "check_model_arg", "build_model",
           "make_batch", "build_model_and_batch", "adapted", "batch_shapes",
           "packing_fields", "packing_words"]

DEFAULT_MODEL = "xlm-roberta-large"
DEFAULT_GPU = "gtx-1080-ti"
# memfit.optimizers.OPTIMIZERS' names (kept here so the parser needs no torch; a test holds them equal)
OPTIMIZER_NAMES = ("adagrad", "adam", "adamw", "momentum", "rmsprop", "sgd")
# techniques.quantized_base.KINDS and packed_int4's "gptq", named here so --help needs no torch
# (tests/cli/test_adapt.py)
QUANTIZE_KINDS = ("nf4", "fp4", "int8", "gptq")
# zoo._spec.ATTENTION, named here so --help needs no torch (tests/cli/test_packing_cli.py)
ATTENTION_NAMES = ("sdpa", "eager", "flash_attention_2")


def add_model_args(p: argparse.ArgumentParser, batch_size: int = 8,
                   lever_auto: bool = False) -> None:
    """``lever_auto``: --batch-size and --seq-len also take 'auto' (the largest that fits)."""
    g = p.add_argument_group("model and batch")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, metavar="NAME",
                     help=f"a built-in model (default: {DEFAULT_MODEL}; list them with "
                          "`memfit models`), a Hugging Face config.json or a folder holding one, "
                          "or a hub id ORG/NAME such as meta-llama/Llama-3.1-8B, read in that "
                          "order: a built-in name first, then an existing path, then the hub. "
                          "A hub id reads only its config.json (weights are random), from the "
                          "local Hugging Face cache first; HF_HUB_OFFLINE=1 keeps to the cache")
    src.add_argument("--config", default=None, metavar="PATH",
                     help="a Hugging Face config.json (or a folder holding one) instead of --model")
    g.add_argument("--revision", default=None, metavar="REV",
                   help="with a hub id in --model: the branch, tag or commit hash whose "
                        "config.json to read (default: main)")
    g.add_argument("--task", default=None,
                   help="training head, e.g. sequence-classification, causal-lm, masked-lm "
                        "(default: the model's usual one; `memfit models` lists each model's)")
    auto = " or 'auto': the largest that fits the budget" if lever_auto else ""
    number = int_or_auto if lever_auto else positive_int
    g.add_argument("--batch-size", type=number, default=batch_size,
                   help=f"samples per step (default: {batch_size}){auto}")
    g.add_argument("--seq-len", "--max-seq-len", dest="seq_len", type=number, default=None,
                   help=f"tokens per sample for text models (default: 256){auto}")
    g.add_argument("--image-size", type=positive_int, default=None,
                   help="image side in pixels for vision models (default: the model's, e.g. 224)")
    g.add_argument("--padded", action="store_true",
                   help="rows of varying length with right padding instead of full rows")
    g.add_argument("--packing", action="store_true",
                   help="padding-free packed sequences, as TRL's packing=True (padding-free) "
                        "and transformers' DataCollatorWithFlattening give a causal LM: "
                        "--batch-size sequences of --seq-len tokens each, flattened into one row "
                        "of batch-size x seq-len tokens (the tokens per batch) whose position_ids "
                        "restart with each sequence; the model's use_cache is off, as the Trainer "
                        "sets it. Attention follows --attn-implementation")
    g.add_argument("--attn-implementation", default=None, choices=ATTENTION_NAMES,
                   help="the model's attention as transformers runs it: sdpa (default where the "
                        "model has it; a packed batch gets a tokens x tokens block-diagonal "
                        "mask), eager, or flash_attention_2 (flash-attn 2, modelled for a GPU "
                        "target: a packed batch runs its variable-length kernel; sm80+, "
                        "fp16/bf16)")
    g.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                   help="do not train the parameters whose names match: a name, a module "
                        "prefix (roberta.embeddings), a glob ('roberta.embeddings.*') or a regex; "
                        "repeat for more")
    g.add_argument("--lora-rank", type=positive_int, default=None, metavar="R",
                   help="train LoRA adapters of rank R on every linear layer instead of the "
                        "weights (needs `pip install peft`)")
    g.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="with --lora-rank: the linear layers that get adapters, comma-separated "
                        "module names (q_proj,v_proj); default: every linear layer but a language "
                        "model's output layer (PEFT's all-linear)")
    g.add_argument("--quantize", default=None, choices=QUANTIZE_KINDS,
                   help="hold the frozen base weights in 4 bits (nf4, fp4: QLoRA with "
                        "--lora-rank) or 8 bits (int8: LLM.int8) with bitsandbytes, as "
                        "loading with BitsAndBytesConfig does, or packed as GPTQ's int4 (gptq: "
                        "gptqmodel's layout and torch kernel, modelled by memfit); needs "
                        "--lora-rank or --freeze")
    g.add_argument("--double-quant", action=argparse.BooleanOptionalAction, default=True,
                   help="with --quantize nf4/fp4: quantize the block scales again (QLoRA's "
                        "bnb_4bit_use_double_quant; default on)")


def add_target_args(g, *, budget_help: str) -> None:
    """--gpu, --device, --cuda-version, --module-loading, --budget and --reserve in ``g``."""
    g.add_argument("--gpu", default=None, metavar="NAME",
                   help=f"GPU to check against, or 'cpu' (default: {DEFAULT_GPU}); list them "
                        "with `memfit gpus`")
    g.add_argument("--device", default=None, metavar="FILE.json",
                   help="a device profile written by `memfit calibrate` on your GPU: its measured "
                        "context, kernels and memory replace the table's (instead of --gpu)")
    g.add_argument("--cuda-version", default=None, type=cuda_version, metavar="X.Y",
                   help="CUDA version whose context and kernels to count, e.g. 12.4 or 11.8 "
                        "(a bare 12 reads as 12.8, 11 as 11.8; default: what the installed torch "
                        "was built for; a CPU-only torch assumes 12.8 and says so)")
    g.add_argument("--module-loading", default=None, choices=("lazy", "eager"),
                   help="CUDA_MODULE_LOADING of the run (default: this shell's "
                        "CUDA_MODULE_LOADING, else lazy, torch's default): eager loads every "
                        "kernel at start, a larger context")
    g.add_argument("--budget", default=None, type=budget_bytes, metavar="BYTES",
                   help=f"{budget_help}; {BYTES_HELP}. A number without a unit under 1 MiB is "
                        "refused (write 11GiB, or 11B if you mean bytes)")
    g.add_argument("--reserve", default=None, type=reserve_bytes, metavar="BYTES",
                   help="keep this much of the GPU free (e.g. 1GiB for a desktop card that "
                        "drives a display): subtracted from its usable memory before checking")


def add_optimizer_impl_arg(g) -> None:
    g.add_argument("--optimizer-impl", default="auto", choices=("auto", *OPTIMIZER_IMPLS),
                   help="how the optimizer steps: foreach (one kernel over all parameters, "
                        "parameter-sized temporaries; CUDA's default), fused (no such "
                        "temporaries; Adam, AdamW, SGD, Adagrad), for-loop (foreach=False), "
                        "compiled (the step under torch.compile: each update fused); "
                        "auto: memfit's choice (default)")


def optimizer_impl_knob(args) -> dict:
    """``{"optimizer_impl": ...}`` when fixed and this memfit has the knob, else ``{}``."""
    value = getattr(args, "optimizer_impl", "auto")
    if value == "auto":
        return {}
    import dataclasses

    from memfit.knobs import Knobs

    if "optimizer_impl" not in {f.name for f in dataclasses.fields(Knobs)}:
        raise ValueError(f"--optimizer-impl {value}: this version of memfit cannot model "
                         "another optimizer implementation yet; leave it at auto")
    return {"optimizer_impl": value}


@dataclass(frozen=True)
class Target:
    """The device to fit and the bytes to fit in (``limit_bytes``), as the flags say."""

    device: object            # DeviceSpec
    limit_bytes: int          # what the step must fit: --budget, else usable - --reserve
    budget_bytes: int | None  # what to pass the API as ``budget`` (None: the device's own)
    reserve_bytes: int        # 0 without --reserve

    @property
    def api_budget(self) -> str | None:
        """``budget_bytes`` with its unit (the flag took one: a refusal names no missing one)."""
        return None if self.budget_bytes is None else f"{self.budget_bytes}B"

    def where(self) -> str:
        from memfit.units import format_bytes

        d = self.device
        if self.budget_bytes is not None and not self.reserve_bytes:
            return f"a budget of {format_bytes(self.limit_bytes)}"
        if self.reserve_bytes:
            return (f"the {d.display_name} ({format_bytes(d.usable_bytes)} usable, less "
                    f"{format_bytes(self.reserve_bytes)} reserved = "
                    f"{format_bytes(self.limit_bytes)})")
        return f"the {d.display_name} ({format_bytes(self.limit_bytes)} usable)"


def resolve_target(args) -> Target:
    """The GPU (checked by name now, not after a trace) and the limit: ``--reserve`` lowers
    the card's usable memory; with ``--budget`` it is refused (the budget is the limit)."""
    from memfit.units import format_bytes

    spec = resolve_device(args)
    reserve = args.reserve or 0
    if args.budget is not None and reserve:
        raise ValueError("--reserve lowers the GPU's usable memory, --budget replaces it: give "
                         "one of them (e.g. --budget set to what you want the step to use)")
    if reserve:
        if reserve >= spec.usable_bytes:
            raise ValueError(f"--reserve {format_bytes(reserve)} is all of the "
                             f"{spec.display_name}'s {format_bytes(spec.usable_bytes)} usable: "
                             "reserve less")
        limit = spec.usable_bytes - reserve
        return Target(spec, limit, limit, reserve)
    if args.budget is not None:
        return Target(spec, args.budget, args.budget, 0)
    return Target(spec, spec.usable_bytes, None, 0)


def resolve_device(args):
    """The DeviceSpec of --gpu or --device, with --cuda-version and --module-loading applied;
    torch is imported only for --gpu cuda (the GPU in this machine)."""
    import os

    from memfit._device_table import DeviceSpec, resolve_name, with_cuda

    gpu, profile = getattr(args, "gpu", None), getattr(args, "device", None)
    if gpu is not None and profile is not None:
        raise ValueError("--gpu names a GPU from the table, --device a measured profile of "
                         "one: give one of them")
    if profile is not None:
        spec = DeviceSpec.load(profile)
    else:
        spec = resolve_name(gpu or DEFAULT_GPU)
        if spec is None:                    # cuda, cuda:N: only torch can describe it
            from memfit.devices import get_device

            spec = get_device(gpu)
    version = getattr(args, "cuda_version", None)
    loading = getattr(args, "module_loading", None)
    if spec.kind != "cuda":
        if version is not None:
            raise ValueError(f"--cuda-version {version} is for a GPU; --gpu {gpu} is not one")
        return spec
    if loading is None and spec.profile_path is None:
        loading = "eager" if os.environ.get("CUDA_MODULE_LOADING", "").upper() == "EAGER" \
            else None
    if spec.profile_path is not None and loading not in (None, spec.module_loading):
        raise ValueError(f"--module-loading {loading}: the profile {profile} was measured with "
                         f"{spec.module_loading} loading; calibrate again under the other")
    if version is None and loading is None:
        return spec
    return with_cuda(spec, version, loading)


def _quiet_transformers() -> None:
    """transformers' info lines about its own defaults are not the user's business here."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def check_model_arg(args) -> None:
    """--model (a built-in name, a path or a hub id), --config (a file), --revision and, for a
    built-in model, --task, checked without torch (``memfit._zoo_names``): refused at once."""
    from memfit._zoo_names import check_task, config_file, find_row, model_source

    revision = getattr(args, "revision", None)
    if args.config:
        if revision is not None:
            raise ValueError(f"--revision {revision} picks a commit of a hub repo; --config "
                             "reads a local file as it is: drop --revision, or give the hub id "
                             "as --model")
        config_file(args.config)
        return
    model = args.model or DEFAULT_MODEL
    if model_source(model, revision) == "builtin" and args.task is not None:
        row = find_row(model)
        check_task(row.name, row.architectures, args.task)


def build_model(args):
    """The model spec and the model on the meta device (no memory), with --freeze,
    --quantize and --lora-rank applied (cli._adapt)."""
    from memfit import zoo

    check_model_arg(args)
    _quiet_transformers()
    revision = getattr(args, "revision", None)
    spec = zoo.from_config_file(args.config, task=args.task) if args.config else \
        zoo.resolve(args.model or DEFAULT_MODEL, revision=revision, task=args.task)
    spec.check_task(args.task)
    model = spec.build(args.task, device="meta",
                       attn_implementation=getattr(args, "attn_implementation", None))
    if getattr(args, "packing", False):        # the refusal that needs the model
        from memfit.zoo._packing import check_packable

        check_packable(model, args.task or spec.default_task)
    return spec, adapted(spec, model, args)


def adapted(spec, model, args):
    """``model`` (built by ``spec``) as the flags train it: --packing's config, --freeze,
    --quantize and --lora-rank applied (cli._adapt); what --what-if rebuilds each row with."""
    from memfit.cli._adapt import apply_freeze, apply_lora, apply_quantize
    from memfit.cli._flag_checks import check_flags

    if getattr(args, "packing", False):
        model.config.use_cache = False      # as the Trainer sets it (trace.packed_attention)
    check_flags(args)
    lora, freeze = getattr(args, "lora_rank", None), getattr(args, "freeze", None)
    if getattr(args, "quantize", None):
        if lora:
            model.requires_grad_(False)      # a quantized base is frozen, LoRA trains beside it
        else:                                # check_flags: --freeze names the frozen layers
            apply_freeze(model, freeze)
            freeze = None
        apply_quantize(model, args.quantize, args.double_quant)
    if lora:
        model = apply_lora(model, lora, args.task or spec.default_task,
                           targets=getattr(args, "lora_targets", None))
    if freeze:
        apply_freeze(model, freeze)
    return model


def packing_fields(args, model, batch) -> dict:
    """``{"packing": {...}}`` for --json under --packing (else ``{}``): the sequences, their
    tokens, the tokens per batch and the attention."""
    if not getattr(args, "packing", False):
        return {}
    from memfit.trace.packed_attention import packed_sequences

    sequences, tokens = packed_sequences(batch) or (1, batch["input_ids"].numel())
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return {"packing": {"sequences": sequences, "sequence_tokens": tokens // sequences,
                        "tokens_per_batch": tokens, "attn_implementation": attn}}


def packing_words(args, model, batch) -> str:
    """What follows "batch 1 x N" in the human output under --packing (else "")."""
    fields = packing_fields(args, model, batch).get("packing")
    if fields is None:
        return ""
    return (f" (packed: {fields['sequences']} sequences x {fields['sequence_tokens']} tokens, "
            f"{fields['attn_implementation']})")


def make_batch(spec, model, args, batch_size: int, seq_len: int | None):
    """The zoo's batch for ``model``: real tensors (the trace reads the token ids), so a batch
    larger than this machine's RAM is refused with the sizes that ask for it."""
    from memfit.cli._adapt import base_model

    try:
        return spec.make_batch(base_model(model), batch_size, seq_len=seq_len,
                               image_size=args.image_size, padded=args.padded, task=args.task,
                               packing=getattr(args, "packing", False))
    except (RuntimeError, OverflowError, MemoryError) as e:
        if isinstance(e, RuntimeError) and not any(
                words in str(e) for words in ("allocate", "overflow", "Overflow", "too large")):
            raise
        shape = f"--batch-size {batch_size}" + (f" x --seq-len {seq_len}" if seq_len else "")
        raise ValueError(f"{shape}: the batch cannot be built in this machine's memory (memfit "
                         "makes the batch's tensors for real: the trace reads its token ids); "
                         "give a smaller --batch-size (a plan for a larger effective batch: "
                         f"--micro-batch-size)") from None


def batch_shapes(batch) -> dict:
    """Each tensor's shape, by key: a batch also holds flags (a contrastive model's
    ``return_loss=True``), which have none."""
    return {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")}


def build_model_and_batch(args):
    """The model on the meta device (no memory) and a real batch for it."""
    spec, model = build_model(args)
    return spec, model, make_batch(spec, model, args, args.batch_size, args.seq_len)


def check_paths(args, *flags: str) -> None:
    """Every output file a flag names, checked before tracing."""
    for flag in flags:
        check_output_path(getattr(args, flag.lstrip("-").replace("-", "_"), None), flag)
