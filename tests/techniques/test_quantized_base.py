"""``QuantizedBase``: a model's frozen linear layers held by bitsandbytes (QLoRA's NF4 / FP4,
LLM.int8), from real weights or on ``meta`` (issue 28 item 2).

Oracles: the layer bytes bitsandbytes' own quantization makes from real weights (a model
quantized for real and estimated is the reference a meta model must equal to the byte, with
LoRA on top), the hand formula of ``tests/integrations/test_quantized_lora.py`` (which holds
the real model to a live-bytes count of a real step), and the outputs of bitsandbytes' own
quantization of the same weights."""

import warnings

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import memfit
from memfit.techniques import QuantizedBase

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

LLAMA = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # bitsandbytes' and peft's advice on CPU
        yield


def _lora_estimate(device: str, config: QuantizedBase.Config) -> memfit.Estimate:
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    model.requires_grad_(False)
    QuantizedBase(config).apply(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 128, (2, 16), generator=g),
             "labels": torch.randint(0, 128, (2, 16), generator=g)}
    return memfit.estimate(memfit.Job(lora, batch), device="cpu")


@pytest.mark.parametrize("kind,double", [("nf4", True), ("nf4", False), ("fp4", True),
                                         ("int8", False)])
def test_a_meta_model_estimates_as_the_same_model_quantized_for_real(kind, double):
    config = QuantizedBase.Config(kind=kind, double_quant=double, compute_dtype="fp32")
    real, meta = _lora_estimate("cpu", config), _lora_estimate("meta", config)
    assert (meta.peak_bytes, meta.breakdown) == (real.peak_bytes, real.breakdown)


def test_the_layers_are_bitsandbytes_own_quantization_of_the_weights():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).requires_grad_(False)
    q = model.model.layers[0].self_attn.q_proj
    reference = bnb.nn.Linear4bit(128, 128, bias=False, compute_dtype=torch.float32,
                                  quant_type="nf4")
    reference.weight = bnb.nn.Params4bit(q.weight.data.clone(), requires_grad=False,
                                         quant_type="nf4")
    reference = reference.to("cpu")
    change = QuantizedBase(QuantizedBase.Config("nf4", compute_dtype="fp32")).apply(model)
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit) and isinstance(model.lm_head, nn.Linear)
    assert torch.equal(layer.weight.data, reference.weight.data)
    x = torch.randn(3, 128)
    assert torch.equal(layer(x), reference(x))
    assert "14 frozen linear layers" in change.notes[0]


def test_gpt2s_conv1d_layers_are_quantized_as_transformers_does():
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64))
    model.transformer.h.requires_grad_(False)
    QuantizedBase(QuantizedBase.Config("nf4", compute_dtype="fp32")).apply(model)
    attn = model.transformer.h[0].attn.c_attn
    assert isinstance(attn, bnb.nn.Linear4bit)
    assert (attn.out_features, attn.in_features) == (192, 64)


def test_what_trains_or_nothing_frozen_is_refused_and_the_model_is_kept():
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="no frozen nn.Linear layer"):
        QuantizedBase(QuantizedBase.Config("nf4")).apply(model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="quantize='nf8'"):
        QuantizedBase.Config("nf8")


@pytest.mark.parametrize("kind,double", [("nf4", True), ("fp4", False), ("int8", False)])
def test_layout_bytes_are_what_a_quantized_layer_holds(kind, double):
    from memfit.measure.attached import attached_tensors, module_tensors
    tech = QuantizedBase(QuantizedBase.Config(kind, double_quant=double, compute_dtype="fp32"))
    for device in ("cpu", "meta"):
        model = nn.Sequential(nn.Linear(128, 96, bias=False).to(device)).requires_grad_(False)
        tech.apply(model)
        layer = model[0]
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in
                    [layer.weight, *attached_tensors(layer.weight), *module_tensors(layer)]}
        assert sum(storages.values()) == tech.layout_bytes(96, 128)


def test_a_full_fine_tune_that_cannot_fit_names_qlora_with_its_numbers():
    from memfit.units import format_bytes
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long),
             "labels": torch.zeros(1, 8, dtype=torch.long)}
    linear = [m.weight for n, m in model.named_modules()
              if isinstance(m, nn.Linear) and n != "lm_head"]
    tech = QuantizedBase(QuantizedBase.Config("nf4"))
    with pytest.raises(memfit.BudgetTooSmall) as refused:
        memfit.plan(memfit.Job(model, batch), budget="64KiB", device="cpu")
    line = next(x for x in str(refused.value).splitlines() if "QLoRA" in x)
    assert f"the {len(linear)} linear layers' weights take " \
        f"{format_bytes(sum(w.numel() * 4 for w in linear))}" in line
    assert f"they take {format_bytes(sum(tech.layout_bytes(*w.shape) for w in linear))}" in line
