"""GPTQ-style packed int4 base weights (``techniques.packed_int4``; issue 28 item 2's "model the
packed layout and say so", no GPTQ library installs on a CPU).

Oracles that are not memfit's counter: the layout's bytes by hand from gptqmodel 7.7's buffer
shapes (Note 1 there); each dequantized weight within half a quantization step of the float one
(plus the fp16 rounding of its scale, times the largest code); ``LiveBytes`` over a real CPU
step of a tiny Llama with peft's GPTQ LoRA layer on the packed layers."""

import math
import warnings

import pytest
import torch
from torch import nn

import memfit
from memfit.techniques.packed_int4 import PackedInt4, PackedInt4Linear
from tests.live_bytes import LiveBytes, alive_storages, job_tensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _hand_bytes(k: int, n: int, group: int, bias: bool) -> int:
    """qweight int32 (k/8, n), qzeros int32 (k/g, n/8), scales fp16 (k/g, n), g_idx int32 (k),
    bias fp16 (n), two shift tables of 8 int32."""
    g = math.ceil(k / group)
    return 4 * math.ceil(k / 8) * n + 4 * g * math.ceil(n / 8) + 2 * g * n + 4 * k + \
        (2 * n if bias else 0) + 2 * 8 * 4


def _bytes(module: nn.Module) -> int:
    return sum(b.untyped_storage().nbytes() for b in module.buffers())


@pytest.mark.parametrize("k, n, group, bias", [(200, 100, 64, True), (256, 96, 128, False)])
def test_layout_is_gptqmodels_and_meta_holds_the_same(k, n, group, bias):
    torch.manual_seed(0)
    real = PackedInt4Linear.from_linear(nn.Linear(k, n, bias=bias), group)
    meta = PackedInt4Linear.from_linear(nn.Linear(k, n, bias=bias, device="meta"), group)
    assert _bytes(real) == _bytes(meta) == _hand_bytes(k, n, group, bias)
    assert {name: (b.shape, b.dtype) for name, b in real.named_buffers()} == \
        {name: (b.shape, b.dtype) for name, b in meta.named_buffers()}


def test_each_weight_is_within_half_a_step():
    torch.manual_seed(0)
    linear = nn.Linear(256, 96)
    packed = PackedInt4Linear.from_linear(linear, 64)
    w = linear.weight.detach().t()                           # (k, n), as gptqmodel holds it
    scale = packed.scales.float()[packed.g_idx.long()]       # each row's group's step
    err = (packed.dequantize().float() - w).abs()
    assert (err <= scale / 2 + 15 * scale * 2.0 ** -11 + 1e-6).all()
    x = torch.randn(4, 256)
    torch.testing.assert_close(packed(x), x @ packed.dequantize().float()
                               + packed.bias.float())


def _tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128))


def _qlora_gptq(model):
    """Frozen, packed, and peft's GPTQ LoRA layer on the packed layers (cli._adapt's way)."""
    from memfit.cli._adapt import apply_lora
    model.requires_grad_(False)
    PackedInt4(PackedInt4.Config(group_size=32)).apply(model)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return apply_lora(model, 4, "causal-lm")


def test_lora_on_the_packed_base_estimates_the_real_step():
    """The forward dequantizes every packed weight and autograd keeps it for backward (Note 2):
    the estimate counts that as the real step holds it, to the byte; a model on meta (the
    layout alone) estimates the same."""
    before = alive_storages()
    model = _qlora_gptq(_tiny_llama())
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj).__name__ == \
        "GPTQLoraLinear"
    g = torch.Generator().manual_seed(2)
    batch = {"input_ids": torch.randint(0, 128, (2, 16), generator=g),
             "labels": torch.randint(0, 128, (2, 16), generator=g)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()

    for _ in range(2):                  # the optimizer's state made
        step()
    est = memfit.estimate(memfit.Job(model, batch, optimizer=optimizer), device="cpu")
    with LiveBytes(device_tensors=job_tensors(before)) as live:
        step()
    assert est.peak_bytes == live.peak_bytes
    meta = _qlora_gptq(_tiny_llama().to("meta"))
    assert memfit.estimate(memfit.Job(meta, batch, optimizer="adamw"), device="cpu").peak_bytes \
        == memfit.estimate(memfit.Job(model, batch, optimizer="adamw"), device="cpu").peak_bytes
