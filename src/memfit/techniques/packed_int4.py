"""GPTQ/AWQ-style packed int4 base weights, held and trained as gptqmodel's torch kernel does.

Note 1 (why memfit builds them). No library that loads GPTQ or AWQ checkpoints installs on this
CPU-only machine (gptqmodel 7.7 builds CUDA extensions; AutoAWQ is archived), so memfit builds
the layout itself, the one gptqmodel's ``PackableQuantLinear`` holds (v2 zero format, 4 bits):
``qweight`` int32 ``(ceil(k / 8), n)``, eight 4-bit codes per word along the input dimension;
``qzeros`` int32 ``(ceil(k / group_size), ceil(n / 8))``; ``scales`` fp16
``(ceil(k / group_size), n)``; ``g_idx`` int32 ``(k,)``, each input row's group; an fp16 bias;
two int32 shift tables (the unpacking's ``wf``, 8 values each). An AWQ checkpoint holds the same
bytes in another order (codes packed along the output dimension). The values are memfit's own
round-to-nearest quantization per group, not GPTQ's error-minimising one: memory does not depend
on them, the numerics do, and a model quantized here is a stand-in for the memory of a GPTQ
model, not a substitute for one.

Note 2 (the forward). gptqmodel trains through its torch kernel (``TorchLinear``; its CUDA
kernels, Marlin and ExLlama, have no backward), whose forward dequantizes the whole weight with
torch ops and multiplies: the zeros and codes unpacked by shifts into int8, the codes minus
their group's zero times its scale (an fp16 ``(k, n)`` weight), cast to the input's dtype,
``matmul``, the bias added in place. ``forward`` below runs those ops in that order (gptqmodel
7.7, ``nn_modules/qlinear/__init__.py``, ``dequantize_weight`` and ``torch.py``,
``_forward_eager``), so a trace counts their temporaries, and autograd keeps the dequantized
weight of every layer for the input's gradient until backward, as it does in gptqmodel. peft
wraps the layer with its own GPTQ LoRA layer (``lora.gptq.GPTQLoraLinear``) once told to
(``LoraConfig._register_custom_module``), and ``target_modules="all-linear"`` matches
``nn.Linear`` only: the CLI names the packed layers (``cli._adapt``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from memfit.techniques._protocol import Change
from memfit.techniques.quantized_base import is_linear

__all__ = ["PackedInt4", "PackedInt4Linear"]

_BITS, _PER_WORD = 4, 8         # 4-bit codes, eight per int32 word


class PackedInt4Linear(nn.Module):
    """A frozen linear layer in the packed int4 layout of Note 1, run as Note 2 says."""

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool,
                 device=None):
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, \
            group_size
        groups = math.ceil(in_features / group_size)
        kw = {"device": device}
        self.register_buffer("qweight", torch.zeros(
            (math.ceil(in_features / _PER_WORD), out_features), dtype=torch.int32, **kw))
        self.register_buffer("qzeros", torch.zeros(
            (groups, math.ceil(out_features / _PER_WORD)), dtype=torch.int32, **kw))
        self.register_buffer("scales", torch.zeros((groups, out_features), dtype=torch.float16,
                                                   **kw))
        self.register_buffer("g_idx", torch.arange(in_features, dtype=torch.int32, **kw)
                             // group_size)
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, **kw)
                             if bias else None)
        shifts = torch.arange(0, 32, _BITS, dtype=torch.int32, **kw).unsqueeze(0)
        self.register_buffer("wf_zero", shifts.unsqueeze(0), persistent=False)       # (1, 1, 8)
        self.register_buffer("wf_neg_one", shifts.unsqueeze(-1), persistent=False)   # (1, 8, 1)

    def dequantize(self) -> torch.Tensor:
        """The fp16 ``(k, n)`` weight, by gptqmodel's torch ops (Note 2)."""
        zeros = torch.bitwise_right_shift(
            self.qzeros.unsqueeze(2).expand(-1, -1, _PER_WORD), self.wf_zero).to(torch.int8)
        zeros = torch.bitwise_and(zeros, 15).reshape(self.qzeros.shape[0], -1)
        zeros = zeros[:, :self.scales.shape[1]]
        weight = torch.bitwise_and(torch.bitwise_right_shift(
            self.qweight.unsqueeze(1).expand(-1, _PER_WORD, -1), self.wf_neg_one)
            .to(torch.int8), 15)
        weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
        weight = weight[:self.in_features]
        g = self.g_idx.long()
        return self.scales[g] * (weight - zeros[g])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_shape = x.shape[:-1] + (self.out_features,)
        x = x.reshape(-1, x.shape[-1])
        weights = self.dequantize()
        if weights.dtype != x.dtype:
            weights = weights.to(dtype=x.dtype)
        out = torch.matmul(x, weights).reshape(out_shape)
        del weights
        if self.bias is not None:
            out.add_(self.bias.to(out.dtype) if self.bias.dtype != out.dtype else self.bias)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, packed int4")

    @classmethod
    def from_linear(cls, linear: nn.Module, group_size: int) -> "PackedInt4Linear":
        """``linear`` (``nn.Linear``, or transformers' ``Conv1D``, whose weight is (in, out))
        quantized to 4 bits per group of input rows, round to nearest (Note 1); on meta, the
        layout alone."""
        w = linear.weight.detach()
        if type(linear) is not nn.Linear:
            w = w.t()
        n, k = w.shape
        module = cls(k, n, group_size, linear.bias is not None, device=w.device)
        if w.device.type == "meta":
            return module
        module.qweight, module.qzeros, module.scales = _quantized(w.t().float(), group_size)
        if linear.bias is not None:
            module.bias = linear.bias.detach().to(torch.float16)
        return module


def _quantized(w: torch.Tensor, group: int):
    """(qweight, qzeros, scales) of a ``(k, n)`` fp32 weight: per group of rows and column, the
    range over 15 steps, the zero rounded, the codes rounded and packed (Note 1)."""
    k, n = w.shape
    groups = math.ceil(k / group)
    padded = torch.nn.functional.pad(w, (0, 0, 0, groups * group - k)).view(groups, group, n)
    lo, hi = padded.amin(1).clamp(max=0), padded.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    codes = torch.round(padded / scales.unsqueeze(1) + zeros.unsqueeze(1)).clamp(0, 15)
    codes = codes.reshape(groups * group, n)[:k].to(torch.int64)
    scales = scales.to(torch.float16)
    return _pack_rows(codes), _pack_rows(zeros.to(torch.int64).t()).t().contiguous(), scales


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """Eight 4-bit codes per int32 along the first dimension (two's complement wraps)."""
    rows = math.ceil(codes.shape[0] / _PER_WORD)
    codes = torch.nn.functional.pad(codes, (0, 0, 0, rows * _PER_WORD - codes.shape[0]))
    shifts = torch.arange(0, 32, _BITS, dtype=torch.int64).view(1, _PER_WORD, 1)
    words = (codes.view(rows, _PER_WORD, -1) << shifts).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class PackedInt4:
    """Hold a model's frozen ``nn.Linear`` layers as packed int4 (Notes 1 and 2)."""

    @dataclass(frozen=True)
    class Config:
        group_size: int = 128             # input rows per scale and zero (GPTQ's default)
        keep: tuple[str, ...] = ("lm_head",)   # module names left in full precision

        def __post_init__(self):
            if self.group_size < 8 or self.group_size % _PER_WORD:
                raise ValueError(f"group_size={self.group_size}: use a multiple of 8 "
                                 "(128 is GPTQ's default)")

    def __init__(self, config: Config | None = None):
        self.config = config or PackedInt4.Config()

    def apply(self, model: nn.Module) -> Change:
        """Replace the frozen linear layers of ``model`` in place; not undone by ``remove``
        (the float weights are gone)."""
        done = 0
        for parent, name, child in self.layers(model):
            setattr(parent, name, PackedInt4Linear.from_linear(child, self.config.group_size))
            done += 1
        if not done:
            raise ValueError(f"quantize='gptq': {type(model).__name__} has no frozen linear "
                             "layer to pack (freeze the base first; only weights that do not "
                             "train are held in 4 bits)")
        return Change(model=model, notes=(
            f"packed int4 base: {done} frozen linear layers in gptqmodel's GPTQ layout (group "
            f"{self.config.group_size}), quantized by memfit to nearest (a stand-in for a GPTQ "
            "checkpoint's memory, not its values); each forward dequantizes the whole weight "
            "as gptqmodel's torch kernel does, and autograd keeps it for backward",))

    def layers(self, model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
        """(parent, name, layer) of every frozen linear layer (``nn.Linear``, GPT-2's
        ``Conv1D``) not kept (Config.keep)."""
        keep = set(self.config.keep)
        return [(parent, name, child) for parent_name, parent in model.named_modules()
                for name, child in parent.named_children()
                if is_linear(child) and not child.weight.requires_grad
                and name not in keep and f"{parent_name}.{name}".lstrip(".") not in keep]

