"""LoRA on a quantized base (QLoRA and its kin), estimated as the user built it (issue 28 item 2).

A tiny Llama's linear layers (all but the head) are quantized by the libraries themselves:
bitsandbytes' ``Linear4bit`` (NF4 and FP4, with and without double quantization), its
``Linear8bitLt`` (LLM.int8), torchao's ``NF4Tensor`` (torchtune's QLoRA base), then peft puts
LoRA adapters on ``q_proj`` and ``v_proj``. Two oracles that are not memfit's counter:

- the weights' bytes by hand, from the layouts the libraries document: 4-bit codes packed two
  per byte, one scale per block of 64 values (fp32; under double quantization uint8, with an
  fp32 scale per 256 blocks, a 256-entry fp32 code book and an fp32 offset), a 16-entry fp32
  code book per weight; int8 values with one fp32 scale per output row; torchao's int8 block
  scales with an fp32 factor per 256 of them and their mean;
- ``LiveBytes`` (``tests/live_bytes.py``) over a real CPU step, starting from what the
  garbage collector finds alive beside the job. A first model is built and dropped before
  that count starts: the libraries make their lookup tables (bitsandbytes' NF4 and dynamic
  code books for its CPU kernels, a few hundred bytes, module globals) at their first use, once
  per process, and they are not the job's.

Both must equal ``memfit.estimate``'s figures to the byte.
"""

import warnings

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import memfit
from tests.live_bytes import LiveBytes, alive_storages, job_tensors

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

CONFIG = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4)
KINDS = ["bnb-nf4", "bnb-nf4-double", "bnb-fp4", "bnb-int8", "torchao-nf4"]
BLOCK = 64


def _quantized(kind: str, linear: nn.Linear) -> nn.Module:
    w = linear.weight.data
    n, k = w.shape
    if kind == "bnb-int8":
        q = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False)
        q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
        return q.to("cpu")                  # bitsandbytes quantizes on the move
    if kind == "torchao-nf4":
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        linear.weight = nn.Parameter(to_nf4(w, block_size=BLOCK, scaler_block_size=256),
                                     requires_grad=False)
        return linear
    quant_type = kind.split("-")[1]
    double = kind.endswith("double")
    q = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.float32, quant_type=quant_type,
                          compress_statistics=double)
    q.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type=quant_type,
                                 compress_statistics=double)
    return q.to("cpu")


def _weight_bytes(kind: str, n: int, k: int) -> int:
    """A quantized n x k weight's bytes by hand (the module note)."""
    values, blocks = n * k, n * k // BLOCK
    if kind == "bnb-int8":
        return values + 4 * n
    if kind == "torchao-nf4":
        # int8 block scales, an fp32 factor per 256 of them (torchao's double_quantize_scalers
        # takes the factors as a view of a (n, 256) tensor, copied out only where n > 1: one
        # scaler block keeps the 256 floats), their fp32 mean, a 16-entry code book
        factors = 256 if blocks // 256 == 1 else blocks // 256
        return values // 2 + blocks + 4 * factors + 4 + 16 * 4
    scales = blocks + 4 + 4 * -(-blocks // 256) + 256 * 4 if kind.endswith("double") else \
        4 * blocks
    return values // 2 + scales + 16 * 4


def build(kind: str):
    """(the LoRA model, the weights' bytes by hand)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    by_hand = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name != "lm_head":
                by_hand += _weight_bytes(kind, *child.weight.shape)
                setattr(module, child_name, _quantized(kind, child))
    by_hand += sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if "proj" not in n)          # embeddings, norms, the head: fp32
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    by_hand += sum(p.numel() * 4 for p in lora.parameters() if p.requires_grad)
    return lora, by_hand


def _step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    optimizer.step()


@pytest.mark.parametrize("kind", KINDS)
def test_estimate_is_the_real_step_and_the_weights_bytes_by_hand(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # bitsandbytes' and peft's advice on CPU
        build(kind)                           # the libraries' tables (the module note)
        before = alive_storages()
        model, by_hand = build(kind)
        g = torch.Generator().manual_seed(1)
        batch = {"input_ids": torch.randint(0, 128, (2, 16), generator=g),
                 "labels": torch.randint(0, 128, (2, 16), generator=g)}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        for _ in range(2):                    # the optimizer's state made
            _step(model, optimizer, batch)
        est = memfit.estimate(memfit.Job(model, batch, optimizer=optimizer), device="cpu")
        with LiveBytes(device_tensors=job_tensors(before)) as live:
            _step(model, optimizer, batch)
    assert est.breakdown["params"] == by_hand
    assert est.peak_bytes == live.peak_bytes
