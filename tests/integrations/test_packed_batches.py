"""Packed (padding-free) batches, estimated (issue 28 item 5).

Oracles that are not memfit's counter:
- ``LiveBytes`` (``tests/live_bytes.py``) over a real CPU step on a batch made by transformers'
  own ``DataCollatorWithFlattening``: the estimate must equal it to the byte, under sdpa (the
  block-diagonal mask transformers builds) and under flash_attention_2 (memfit's flash-attn ops
  run on real CPU tensors inside a ``FlashAttn`` context: the test checks the trace of
  transformers' varlen path, the ops' own buffers are checked by hand in
  tests/trace/test_cuda_flash_attn.py);
- the token counts: a padded batch and a packed one holding the same real tokens, counted from
  their masks and labels.
"""

import contextlib

import pytest
import torch
from transformers import DataCollatorWithFlattening

import memfit
from memfit import zoo
from memfit.trace.cuda_flash_attn import FlashAttn
from tests.live_bytes import LiveBytes, alive_storages, job_tensors


def _step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    optimizer.step()


def _model(name, attn="sdpa", dtype=None, device="cpu"):
    model = zoo.get(name).build("causal-lm", tiny=True, attn_implementation=attn, dtype=dtype,
                                device=device)
    model.config.use_cache = False            # as the Trainer sets it (packed_attention Note 1)
    return model


@pytest.mark.parametrize("name, attn, dtype", [
    ("llama-1b", "sdpa", None), ("gpt2", "sdpa", None), ("qwen2.5-7b", "eager", None),
    ("llama-1b", "flash_attention_2", torch.bfloat16)])
def test_estimate_is_the_real_step(name, attn, dtype):
    flash = FlashAttn((8, 0), "A100") if attn == "flash_attention_2" else \
        contextlib.nullcontext()
    with flash:
        before = alive_storages()
        model = _model(name, attn, dtype)
        g = torch.Generator().manual_seed(1)
        features = [{"input_ids": torch.randint(3, 100, (n,), generator=g).tolist()}
                    for n in (40, 24, 33)]
        batch = DataCollatorWithFlattening()(features)     # transformers' own packed batch
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):                    # the optimizer's state made
            _step(model, optimizer, batch)
        est = memfit.estimate(memfit.Job(model, batch, optimizer=optimizer), device="cpu")
        with LiveBytes(device_tensors=job_tensors(before)) as live:
            _step(model, optimizer, batch)
    assert est.peak_bytes == live.peak_bytes
    assert any(n.startswith("packed batch: 3 sequences in 97 tokens") for n in est.notes)


def _same_tokens(model):
    """A padded batch (rows of 64 down to 32 real tokens) and a packed one of the same rows."""
    padded = zoo.get("llama-1b").make_batch(model, 4, seq_len=64, padded=True)
    lengths = padded["attention_mask"].sum(1).tolist()
    packed = zoo.packed_batch(model, lengths)
    # the same tokens are predicted: a padded row of n real tokens has n - 1 targets, so has
    # a packed sequence of n (its first label is -100)
    targets = lambda b: int((b["labels"][:, 1:] != -100).sum())   # noqa: E731
    assert packed["input_ids"].shape == (1, sum(lengths)) and targets(packed) == targets(padded)
    return padded, packed


@pytest.mark.parametrize("attn, device", [("sdpa", "cpu"), ("sdpa", "rtx-4090"),
                                          ("flash_attention_2", "rtx-4090")])
def test_packed_holds_fewer_activation_bytes_than_padded(attn, device):
    model = _model("llama-1b", attn, device="meta")
    padded, packed = _same_tokens(model)
    precision = "bf16" if device != "cpu" else "fp32"
    est = {name: memfit.estimate(model, b, device=device, precision=precision)
           for name, b in (("padded", padded), ("packed", packed))}
    assert est["packed"].breakdown["activations"] < est["padded"].breakdown["activations"]
    assert est["packed"].peak_bytes < est["padded"].peak_bytes


def test_gpu_notes_say_which_kernel_ran():
    flash, sdpa = _model("llama-1b", "flash_attention_2", device="meta"), \
        _model("llama-1b", device="meta")
    batch = zoo.packed_batch(flash, [40, 24, 64])
    notes = memfit.estimate(flash, batch, device="rtx-4090", precision="bf16").notes
    assert any(n.startswith("flash_attention_2 on the NVIDIA GeForce RTX 4090: 2x varlen "
                            "(3 sequences in 128 tokens)") for n in notes)
    assert "packed batch: 3 sequences in 128 tokens (position_ids restart); flash_attention_2 " \
           "runs flash_attn_varlen_func on them: no tokens x tokens mask" in notes
    notes = memfit.estimate(sdpa, batch, device="rtx-4090", precision="bf16").notes
    assert "attention ran 2x efficient" in notes[0]          # a mask keeps SDPA off flash
    assert any("sdpa gets a 128x128 block-diagonal causal mask (16.00 KiB as bool); on the "
               "NVIDIA GeForce RTX 4090 SDPA ran efficient with it" in n for n in notes)


def test_a_cache_in_the_forward_is_said_to_undo_the_packing():
    model = zoo.get("llama-1b").build("causal-lm", tiny=True, device="meta")
    assert model.config.use_cache                  # the config's default, outside the Trainer
    est = memfit.estimate(model, zoo.packed_batch(model, [10, 20]), device="rtx-4090",
                          precision="bf16")
    assert "attention ran 2x flash" in est.notes[0]          # no mask was made: is_causal
    assert any("config.use_cache is True" in n and "use_cache = False" in n for n in est.notes)


def test_flash_attention_on_the_cpu_is_refused_with_the_fix():
    model = _model("llama-1b", "flash_attention_2", device="meta")
    with pytest.raises(ValueError, match="no CPU kernel.*device='rtx-4090'"):
        memfit.estimate(model, zoo.packed_batch(model, [8, 8]), device="cpu")
