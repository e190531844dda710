"""--freeze and --lora-rank: which parameters train, set on the meta model before any trace.

Note 1 (patterns). A --freeze PATTERN matches a parameter's qualified name (as
``model.named_parameters()`` gives it) when it is the name, a module prefix of it
(``roberta.embeddings`` freezes every parameter under that module), a shell-style glob
(``roberta.encoder.layer.[0-5].*``, fnmatch) or a Python regular expression matching the whole
name (``.*\\.bias``). Under --lora-rank the names are also matched without PEFT's
``base_model.model.`` prefix, so the same pattern works with and without LoRA. A pattern that
matches nothing is an error naming some parameters, not a silent no-op.

Note 2 (LoRA). --lora-rank R wraps the model with ``peft.get_peft_model`` and a
``LoraConfig(r=R, lora_alpha=2R, target_modules="all-linear")`` (every linear layer but a
language model's output layer, PEFT's own rule, Note 4); for the zoo's tasks PEFT's task type
is set, so a classification head stays trainable as PEFT trains it. The base weights are frozen by PEFT;
memfit counts what PEFT leaves trainable, as it would for the user's own PEFT model.
--lora-targets q_proj,v_proj gives PEFT those module names instead of "all-linear". A class
that subclasses ``nn.Linear`` with a forward of its own (PhiMoE's router returns a tuple) is
no linear layer to LoRA, whose wrapper reads its output as a tensor and fails; "all-linear"
would take it, so the default leaves out a subclass whose forward returns no tensor (PEFT's
``exclude_modules``); Falcon's ``FalconLinear`` (a tensor) and bitsandbytes' quantized linears
(QLoRA's base) stay in.

Note 3 (a quantized base). --quantize nf4|fp4|int8 holds the frozen linear layers in 4 or 8 bits
(``techniques.quantized_base``: bitsandbytes' own modules, the layers transformers keeps in full
precision left alone), before LoRA, as QLoRA loads a quantized model and then adds adapters:
with --lora-rank the whole base is frozen first (a quantized weight cannot train; PEFT trains
the adapters, and a task's head as it always does), with --freeze only what the patterns name.
The weights stay on ``meta``: a 70B base is described, never quantized for real. --quantize gptq
packs them as GPTQ's int4 layout instead (``techniques.packed_int4``: memfit's own modules, no
GPTQ library installs on a CPU), and LoRA goes on the packed layers by name.

Note 4 (a model whose only linear layer is its head). "all-linear" leaves out the output
embedding a language model ties to its vocabulary, not a classifier: on a convolutional
classifier (ResNet, ConvNeXt's stages are convolutions) the head is the one linear layer, and
LoRA adapts it alone. That is PEFT's rule, so memfit counts it, with a warning that says so and
how to adapt the convolutions (``--lora-targets``). A head is a layer with the config's
``num_labels`` outputs.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
import re
import warnings

from memfit.techniques.packed_int4 import PackedInt4, PackedInt4Linear
from memfit.techniques.quantized_base import QuantizedBase

__all__ = ["apply_freeze", "apply_lora", "apply_quantize", "base_model", "parameter_count",
           "adaptation",
           "LORA_TASK_TYPES"]

_PEFT_PREFIX = "base_model.model."

# memfit task -> peft TaskType name
LORA_TASK_TYPES = {"sequence-classification": "SEQ_CLS", "token-classification": "TOKEN_CLS",
                   "causal-lm": "CAUSAL_LM", "seq2seq-lm": "SEQ_2_SEQ_LM"}


def _matcher(pattern: str):
    try:
        regex = re.compile(pattern)
    except re.error:
        regex = None

    def match(name: str) -> bool:
        return (name == pattern or name.startswith(pattern.rstrip(".") + ".")
                or fnmatch.fnmatchcase(name, pattern)
                or (regex is not None and regex.fullmatch(name) is not None))
    return match


def apply_freeze(model, patterns: list[str]) -> int:
    """Set ``requires_grad=False`` on every parameter a pattern matches (Note 1); returns how
    many parameters were frozen. Raises ``ValueError`` for a pattern that matches nothing, or
    when nothing is left to train."""
    named = list(model.named_parameters())
    frozen = 0
    for pattern in patterns:
        match = _matcher(pattern)
        hits = [p for n, p in named if match(n) or match(n.removeprefix(_PEFT_PREFIX))]
        if not hits:
            names = [n.removeprefix(_PEFT_PREFIX) for n, _ in named]
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3) or names[:3]
            raise ValueError(f"--freeze {pattern!r} matches no parameter of "
                             f"{type(model).__name__}; parameter names look like "
                             f"{', '.join(close)} (a name, a module prefix, a glob or a regex)")
        for p in hits:
            frozen += p.requires_grad
            p.requires_grad_(False)
    if not any(p.requires_grad for _, p in named):
        raise ValueError(f"--freeze {' '.join(patterns)} freezes every parameter: nothing is "
                         "left to train (an optimizer needs at least one trainable parameter)")
    return frozen


def apply_quantize(model, kind: str, double_quant: bool) -> None:
    """The frozen linear layers held by bitsandbytes, or packed as GPTQ's int4 (Note 3)."""
    if kind == "gptq":
        PackedInt4(PackedInt4.Config()).apply(model)
        return
    QuantizedBase(QuantizedBase.Config(kind=kind, double_quant=double_quant)).apply(model)


def apply_lora(model, rank: int, task: str | None, targets: str | None = None):
    """The model wrapped for LoRA training by PEFT (Note 2)."""
    try:
        import peft
    except ImportError:
        raise ValueError("--lora-rank needs PEFT, which is not installed: pip install peft "
                         "(or leave --lora-rank out)") from None
    kwargs = {}
    if task in LORA_TASK_TYPES:
        kwargs["task_type"] = getattr(peft.TaskType, LORA_TASK_TYPES[task])
    packed = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                     if isinstance(m, PackedInt4Linear)})
    modules = (packed or "all-linear") if targets is None else \
        [t.strip() for t in targets.split(",") if t.strip()]
    odd = _odd_linears(model) if targets is None else []       # Note 2
    if odd:
        if "exclude_modules" not in inspect.signature(peft.LoraConfig).parameters:
            raise ValueError(f"--lora-rank {rank}: {', '.join(odd[:3])} subclass a linear layer "
                             "with a forward of their own, which LoRA cannot wrap, and this "
                             "PEFT cannot leave them out of 'all-linear': give --lora-targets "
                             "(e.g. q_proj,v_proj) or upgrade peft (>= 0.14)")
        kwargs["exclude_modules"] = odd
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, **kwargs)
    if packed:          # peft's own GPTQ LoRA layer around them (Note 3)
        from peft.tuners.lora.gptq import GPTQLoraLinear
        config._register_custom_module({PackedInt4Linear: GPTQLoraLinear})
    try:
        with warnings.catch_warnings():
            # PEFT reads in/out_features off memfit's packed layer, and warns that it does not
            # know the class it was just given a LoRA layer for (Note 3): nothing to act on
            warnings.filterwarnings("ignore", message="Unsupported layer type .*PackedInt4Linear")
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        from torch import nn
        from transformers.pytorch_utils import Conv1D        # GPT-2's linear layers

        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, (nn.Linear, Conv1D)) and n})
        raise ValueError(f"--lora-rank {rank}: PEFT cannot add LoRA to "
                         f"{type(model).__name__}: {e} (its linear layers, by name, for "
                         f"--lora-targets: {', '.join(linears)})") from e
    if targets is None:
        _warn_head_only(wrapped, rank)
    return wrapped


def _warn_head_only(wrapped, rank: int) -> None:
    """Note 4: "all-linear" found the classification head alone."""
    from peft.tuners.lora import LoraLayer

    adapted = [(n, m) for n, m in wrapped.named_modules() if isinstance(m, LoraLayer)]
    labels = getattr(getattr(wrapped, "config", None), "num_labels", None)
    if not adapted or labels is None or any(getattr(m, "out_features", None) != labels
                                            for _, m in adapted):
        return
    names = ", ".join(n.removeprefix("base_model.model.") for n, _ in adapted)
    base = type(wrapped.get_base_model()).__name__
    warnings.warn(f"--lora-rank {rank}: the only linear layer of {base} is its head ({names}), "
                  "so LoRA adapts the head alone and every other weight stays frozen. For "
                  "adapters on its other layers give their names in --lora-targets (PEFT also "
                  "adapts Conv2d layers); to train the whole model, leave --lora-rank out",
                  stacklevel=3)


def _odd_linears(model) -> list[str]:
    """Modules of a class that subclasses ``nn.Linear`` with a forward of its own that returns
    no tensor (Note 2): each such class called once, on one row of zeros where its weight is.
    Falcon's ``FalconLinear`` returns a tensor, and stays a target."""
    import torch
    from torch import nn

    odd: dict[type, bool] = {}
    names = []
    for name, m in model.named_modules():
        cls = type(m)
        if not isinstance(m, nn.Linear) or cls.forward is nn.Linear.forward or \
                cls.__module__.startswith("bitsandbytes"):
            continue
        if cls not in odd:
            try:
                with torch.no_grad():
                    out = m(torch.zeros(1, m.in_features, device=m.weight.device,
                                        dtype=m.weight.dtype))
                odd[cls] = not isinstance(out, torch.Tensor)
            except Exception:           # a forward that needs more: LoRA's own error decides
                odd[cls] = False
        if odd[cls]:
            names.append(name)
    return names


def parameter_count(model) -> int:
    """The model's parameters as its float weights count them: a 4-bit weight by the shape it
    stands for (bitsandbytes packs two codes a byte: ``quant_state.shape``), a GPTQ layer by
    its ``in_features x out_features`` (its codes are buffers)."""
    total = 0
    for p in model.parameters():
        shape = getattr(getattr(p, "quant_state", None), "shape", None)
        total += shape.numel() if shape is not None else p.numel()
    return total + sum(m.in_features * m.out_features for m in model.modules()
                       if isinstance(m, PackedInt4Linear))


def base_model(model):
    """The transformers model inside a PEFT wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def adaptation(args) -> dict:
    """How the CLI changed the model before tracing, for ``--json`` (the quantized base is
    the model's own, so the plan's ``knobs.quantize_base`` does not carry it)."""
    out = {}
    if getattr(args, "lora_rank", None):
        out["lora_rank"] = args.lora_rank
    if getattr(args, "quantize", None):
        out["quantize"] = args.quantize
        if args.quantize in ("nf4", "fp4"):
            out["double_quant"] = bool(args.double_quant)
    if getattr(args, "freeze", None):
        out["freeze"] = list(args.freeze)
    return out
