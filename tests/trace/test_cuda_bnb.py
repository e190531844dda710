"""bitsandbytes' 4-bit matmul on a GPU target (``memfit.trace.cuda_bnb``, issue 28 item 2).

The CUDA fallback (``_dequant_linear_fallback``, bitsandbytes 0.50) is the same computation as
bitsandbytes' own default kernel (``backends/default/ops.py``: the nested scales dequantized and
offset, the weight dequantized, ``F.linear``), which runs on the CPU. Oracle: that default kernel
called as Python on real tensors, counted by ``LiveBytes`` (not memfit's counter) and compared
bitwise; ``CudaBnbMode`` must allocate what it allocates (and the one buffer the CUDA source
keeps longer) and give the same output."""

import warnings

import pytest
import torch

import memfit
from memfit.trace.cuda_bnb import CudaBnbMode
from tests.live_bytes import LiveBytes

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


@pytest.mark.parametrize("double", [True, False])
def test_the_fallback_allocates_and_computes_what_bitsandbytes_default_kernel_does(double):
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    layer = bnb.nn.Linear4bit(64, 96, bias=False, compute_dtype=torch.float32,
                              quant_type="nf4", compress_statistics=double)
    layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4",
                                     compress_statistics=double)
    layer = layer.to("cpu")
    s = layer.weight.quant_state
    a = torch.randn(2000, 64)                   # M > 1536: the fallback on every card
    args = (a, layer.weight.view(-1, 1), list(s.shape), s.state2.absmax if double else s.absmax,
            s.blocksize, s.quant_type)
    nested = dict(absmax_8bit=s.absmax, absmax_code=s.state2.code, absmax_offset=s.offset) \
        if double else {}
    with LiveBytes() as reference:
        expected = _gemm_4bit_default_impl(*args, **nested)
    mode = CudaBnbMode()
    with LiveBytes() as modelled, mode:
        got = torch.ops.bitsandbytes.gemm_4bit.default(*args, **nested)
    assert torch.equal(got, expected)
    # one difference, by the sources: the CUDA fallback keeps its fp32 ``absmax_dq`` (a name)
    # alive beside ``absmax_dq + offset`` until it returns; the default kernel's is a temporary
    kept = 4 * s.absmax.numel() if double else 0
    assert modelled.peak_bytes == reference.peak_bytes + kept
    assert mode.fallback == 1 and "1 on a dequantized weight" in mode.note()


def _qlora_notes(tokens: int) -> list[str]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from memfit.techniques import QuantizedBase
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=128,
                                             intermediate_size=256, num_hidden_layers=1,
                                             num_attention_heads=4))
    model.requires_grad_(False)
    QuantizedBase(QuantizedBase.Config("nf4")).apply(model)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    batch = {"input_ids": torch.zeros(1, tokens, dtype=torch.long),
             "labels": torch.zeros(1, tokens, dtype=torch.long)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return memfit.estimate(memfit.Job(lora, batch), device="rtx-4090",
                               precision="bf16").notes


@pytest.mark.parametrize("tokens,words", [
    (2048, "7 on a dequantized weight"),
    (512, "7 counted with the dequantized weight although the card may run its fused kernel"),
    (4, "7 in the fused kernel"),
])
def test_a_gpu_estimate_says_how_each_4bit_matmul_was_counted(tokens, words):
    notes = [n for n in _qlora_notes(tokens) if "bitsandbytes 4-bit matmuls" in n]
    assert len(notes) == 1 and words in notes[0]
