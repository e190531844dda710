"""Quantized base weights: the frozen linear layers of a model held in 4 or 8 bits by
bitsandbytes, as QLoRA (NF4 / FP4) and LLM.int8 fine-tuning load them.

Note 1 (what is replaced). Every ``nn.Linear`` (and transformers' ``Conv1D``, GPT-2's linear
layer, whose (in, out) weight is transposed first, as transformers does) whose weight does not
train, except those
transformers keeps in full precision when it quantizes (``get_keys_to_not_convert``: the output
embeddings, tied weights, the last module; ``Config.keep`` adds names), becomes bitsandbytes'
own module: ``Linear4bit`` (``kind`` "nf4" or "fp4"; ``double_quant`` quantizes the block scales
again, QLoRA's ``bnb_4bit_use_double_quant``; ``compute_dtype`` is its
``bnb_4bit_compute_dtype``) or ``Linear8bitLt`` (``kind="int8"``, ``has_fp16_weights=False``,
outlier threshold 6.0: transformers' ``load_in_8bit`` defaults). Apply it before LoRA, as
loading a quantized model and then calling ``peft.get_peft_model`` does: PEFT's LoRA layers wrap
bitsandbytes' modules. A linear layer whose weight trains is left alone (its weight must stay a
float to have a gradient).

Note 2 (real or meta weights). Real weights are quantized by bitsandbytes itself (its
``Params4bit`` / ``Int8Params`` quantize when moved to their device). A model on the ``meta``
device (a 70B config, never materialised) gets the same modules with meta tensors of the
layouts bitsandbytes makes: codes packed two per byte (``(n*k + 1) // 2`` uint8) or one int8
per value, a 16-entry fp32 code book, one scale per ``blocksize`` values (fp32; uint8 under
double quantization, with a nested state of one fp32 scale per 256 of them, its 256-entry
fp32 code book and an fp32 offset); int8: one fp32 scale per output row. The int8 module is
given the state its first forward would make (``MatmulLtState.CB``/``SCB``), the weight itself
as ``CB``, so a trace counts the int8 values once. The estimate of the meta model equals the
estimate of the same model quantized for real (tests/techniques/test_quantized_base.py).

Note 3 (numerics). The forward and backward run on dequantized weights: outputs differ from the
float model's (NF4's error is about 1e-2 relative); the planner offers it only under
``allow_numerics_change``.

Note 4 (the knob ``quantize_base``). A trace cannot quantize fakes (bitsandbytes' ``Params4bit``
wraps a plain tensor, and a fake already has its Python object), so ``twin`` quantizes a copy of
the model whose float tensors are on meta (Note 2's layouts), leaving the user's model as it is;
the trace fakes that copy. A run applies the technique to the model itself, in place, where a
frozen linear layer is still float (``pending``): the same modules, so the run holds what the
trace counted. Weights that already hold a quantization (a subclass, or state attached) are
shared with the copy, not moved to meta.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from memfit.measure.attached import attached_tensors, module_tensors
from memfit.techniques._bnb_optimizer import import_bitsandbytes
from memfit.techniques._protocol import Change

__all__ = ["QuantizedBase", "KINDS"]

KINDS = ("nf4", "fp4", "int8")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class QuantizedBase:
    """Hold a model's frozen linear weights in 4 or 8 bits with bitsandbytes (Notes 1-3)."""

    @dataclass(frozen=True)
    class Config:
        kind: str = "nf4"                 # "nf4", "fp4" (Linear4bit) or "int8" (Linear8bitLt)
        double_quant: bool = True         # 4-bit: the block scales quantized again (QLoRA)
        compute_dtype: str = "bf16"       # 4-bit: the dtype the matmul runs in
        blocksize: int = 64               # 4-bit: values per scale
        keep: tuple[str, ...] = ()        # more module names to leave in full precision

        def __post_init__(self):
            if self.kind not in KINDS:
                raise ValueError(f"quantize={self.kind!r}: use one of {', '.join(KINDS)}")
            if self.compute_dtype not in _DTYPES:
                raise ValueError(f"compute_dtype={self.compute_dtype!r}: use one of "
                                 f"{', '.join(_DTYPES)}")
            if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
                raise ValueError(f"blocksize={self.blocksize}: bitsandbytes takes a power of "
                                 "two from 32 to 4096 (64 is QLoRA's)")

    def __init__(self, config: Config | None = None):
        self.config = config or QuantizedBase.Config()

    def apply(self, model: nn.Module) -> Change:
        """Replace the frozen linear layers of ``model`` in place (Note 1); the ``Change``
        names how many and what they now hold. The replacement is not undone by ``remove``:
        the float weights are gone (Note 3)."""
        bnb = _bitsandbytes()
        done, saved = 0, 0
        for parent, name, child in self.layers(model):
            if child.weight.requires_grad:
                continue
            before = child.weight.numel() * child.weight.element_size()
            quantized = self._quantized(bnb, child)
            setattr(parent, name, quantized)
            done += 1
            saved += before - _weight_bytes(quantized)
        if not done:
            raise ValueError(f"quantize={self.config.kind!r}: {type(model).__name__} has no "
                             "frozen nn.Linear layer to quantize (freeze the base first, or "
                             "apply it before LoRA: only weights that do not train are held in "
                             "4 or 8 bits)")
        c = self.config
        how = "LLM.int8" if c.kind == "int8" else \
            f"{c.kind.upper()}{' with double quantization' if c.double_quant else ''}, " \
            f"compute in {c.compute_dtype}"
        return Change(model=model, notes=(
            f"quantized base: {done} frozen linear layers held by bitsandbytes ({how}), "
            f"{saved / 2**20:.1f} MiB less than their float weights; their outputs change "
            "(numerics)",))

    def pending(self, model: nn.Module) -> bool:
        """Whether ``apply`` would quantize a layer of ``model`` (a frozen float linear)."""
        return any(not child.weight.requires_grad for _, _, child in self.layers(model))

    def twin(self, model: nn.Module) -> tuple[nn.Module, Change]:
        """A copy of ``model`` with its float tensors on meta, quantized (Note 4), and the
        ``Change`` that says so; ``model`` is not touched."""
        memo = {}
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) in memo:
                continue
            if type(t) not in (torch.Tensor, nn.Parameter) or attached_tensors(t):
                memo[id(t)] = t                      # already quantized: shared (Note 4)
                continue
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else meta
        twin = copy.deepcopy(model, memo)
        return twin, self.apply(twin)

    def layers(self, model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
        """(parent, name, layer) of every linear layer ``apply`` would quantize were its weight
        frozen (Note 1)."""
        keep = _kept(model) | set(self.config.keep)
        out = []
        for parent_name, parent in model.named_modules():
            for name, child in parent.named_children():
                full = f"{parent_name}.{name}" if parent_name else name
                if is_linear(child) and full not in keep and name not in keep:
                    out.append((parent, name, child))
        return out

    def layout_bytes(self, n: int, k: int) -> int:
        """The bytes an n x k weight takes quantized, by the layouts of Note 2."""
        c = self.config
        if c.kind == "int8":
            return n * k + 4 * n
        blocks = math.ceil(n * k / c.blocksize)
        scales = blocks + 4 + 4 * math.ceil(blocks / 256) + 4 * 256 if c.double_quant else \
            4 * blocks
        return (n * k + 1) // 2 + scales + 4 * 16

    def _quantized(self, bnb, linear: nn.Module) -> nn.Module:
        c, w = self.config, linear.weight
        if type(linear) is not nn.Linear:          # Conv1D: (in, out), transposed (Note 1)
            w = nn.Parameter(w.detach().t().contiguous(), requires_grad=False)
        n, k = w.shape
        meta = w.device.type == "meta"
        if c.kind == "int8":
            module = bnb.nn.Linear8bitLt(k, n, bias=linear.bias is not None,
                                         has_fp16_weights=False, threshold=6.0, device="meta")
            if meta:
                _int8_on_meta(bnb, module, n, k)
            else:
                module.weight = bnb.nn.Int8Params(w.data, requires_grad=False,
                                                  has_fp16_weights=False)
        else:
            module = bnb.nn.Linear4bit(k, n, bias=linear.bias is not None,
                                       compute_dtype=_DTYPES[c.compute_dtype],
                                       compress_statistics=c.double_quant, quant_type=c.kind,
                                       device="meta")
            module.weight = _4bit_on_meta(bnb, c, w) if meta else bnb.nn.Params4bit(
                w.data, requires_grad=False, blocksize=c.blocksize,
                compress_statistics=c.double_quant, quant_type=c.kind)
        if linear.bias is not None:
            module.bias = linear.bias
        return module if meta else module.to(w.device)     # bitsandbytes quantizes here


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear``, or transformers' ``Conv1D`` (GPT-2's linear layers, weight stored
    (in, out)), which transformers quantizes too."""
    return type(module) is nn.Linear or type(module).__name__ == "Conv1D" and \
        type(module).__module__.startswith("transformers")


def _bitsandbytes():
    try:
        bitsandbytes = import_bitsandbytes()
    except ImportError:
        raise ValueError("quantized base weights need bitsandbytes: pip install bitsandbytes "
                         "(its CPU backend runs without a GPU)") from None
    return bitsandbytes


def _kept(model: nn.Module) -> set[str]:
    """The modules transformers leaves in full precision when it quantizes (Note 1)."""
    if not hasattr(model, "get_output_embeddings"):
        return set()
    try:
        from transformers.quantizers.base import get_keys_to_not_convert
        return set(get_keys_to_not_convert(model))
    except Exception:     # noqa: BLE001 - an older transformers or a model without the API
        head = model.get_output_embeddings()
        return {n for n, m in model.named_modules() if m is head}


def _4bit_on_meta(bnb, c: "QuantizedBase.Config", w: torch.Tensor):
    """A ``Params4bit`` on meta with the layout bitsandbytes makes (Note 2)."""
    n, k = w.shape
    blocks = math.ceil(n * k / c.blocksize)
    meta = {"device": "meta"}
    offset, state2 = None, None
    if c.double_quant:
        absmax = torch.empty(blocks, dtype=torch.uint8, **meta)
        offset = torch.empty((), dtype=torch.float32, **meta)
        state2 = bnb.functional.QuantState(
            absmax=torch.empty(math.ceil(blocks / 256), dtype=torch.float32, **meta),
            code=torch.empty(256, dtype=torch.float32, **meta), blocksize=256,
            dtype=torch.float32)
    else:
        absmax = torch.empty(blocks, dtype=torch.float32, **meta)
    state = bnb.functional.QuantState(
        absmax=absmax, shape=torch.Size((n, k)), code=torch.empty(16, dtype=torch.float32, **meta),
        blocksize=c.blocksize, quant_type=c.kind, dtype=w.dtype, offset=offset, state2=state2)
    return bnb.nn.Params4bit(torch.empty(((n * k + 1) // 2, 1), dtype=torch.uint8, **meta),
                             requires_grad=False, quant_state=state, blocksize=c.blocksize,
                             compress_statistics=c.double_quant, quant_type=c.kind,
                             bnb_quantized=True)


def _int8_on_meta(bnb, module: nn.Module, n: int, k: int) -> None:
    """An int8 weight on meta in the state its first forward leaves (Note 2)."""
    weight = bnb.nn.Int8Params(torch.empty((n, k), dtype=torch.int8, device="meta"),
                               requires_grad=False, has_fp16_weights=False)
    module.weight = weight
    weight.CB = weight.SCB = None
    module.state.CB = weight
    module.state.SCB = torch.empty(n, dtype=torch.float32, device="meta")


def _weight_bytes(module: nn.Module) -> int:
    """The bytes of a quantized module's weight and its state, each storage once."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [module.weight, *attached_tensors(module.weight),
                          *module_tensors(module)]}
    return sum(storages.values())
