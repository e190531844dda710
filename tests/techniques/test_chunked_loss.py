"""Chunked cross-entropy over the LM head (``techniques.chunked_loss``, issue 28 item 4).

Oracles that are not memfit's counter:
- the model's own loss (transformers' ``ForCausalLMLoss``, the labels shifted, -100 left out)
  and its gradients, on unmodified Llama, GPT-2 and Qwen2 models with random weights: the
  chunked loss adds the same terms in another order, so fp32 is held to rtol 1e-6 on the loss
  and, on every gradient, each element to within 1e-5 of the tensor's largest (tokens'
  contributions to a weight's gradient cancel, so an element near zero has no relative
  tolerance to speak of); in one piece the order is the model's and everything is bitwise;
- ``LiveBytes`` (``tests/live_bytes.py``) over a real CPU step of the model with the technique
  applied by hand: ``memfit.estimate(..., chunked_loss=8)`` equals it to the byte, and the
  peak drops against the model's own loss (a vocabulary of 32000 over 2 x 256 tokens, hidden
  64: the fp32 logits alone are 65.5 MB).
"""

import pytest
import torch
from torch import nn
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

import memfit
from memfit.knobs import Knobs
from memfit.techniques.chunked_loss import ChunkedLoss
from tests.live_bytes import LiveBytes, alive_storages, job_tensors

VOCAB = 500
_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_SMALL)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_SMALL)),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2,
                                               vocab_size=VOCAB, n_positions=64,
                                               bos_token_id=0, eos_token_id=0)),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()          # no dropout: the two runs draw nothing


def _batch(seq: int = 24, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100                  # a prompt left out of the loss
    labels[1, -3:] = -100                 # padding
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch, **extra):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **extra)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("chunks", [1, 5, 8, 100])
def test_loss_and_gradients_equal_the_models_own(name, chunks):
    model, batch = _model(name), _batch()
    want, want_grads = _loss_and_grads(model, batch)
    change = ChunkedLoss(ChunkedLoss.Config(chunks)).apply(model)
    got, got_grads = _loss_and_grads(model, batch)
    change.remove()
    assert got.logits.shape == (2, 0, VOCAB)            # the whole logits never made
    if chunks == 1:
        assert torch.equal(got.loss, want.loss)
        assert all(torch.equal(got_grads[n], g) for n, g in want_grads.items())
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    for n, g in want_grads.items():
        torch.testing.assert_close(got_grads[n], g, rtol=1e-5, atol=1e-5 * g.abs().max().item(),
                                   msg=n)


def test_num_items_in_batch_and_a_call_without_labels():
    """The sum over ``num_items_in_batch`` (what the Trainer passes under accumulation) as the
    model takes it; without labels the model runs as it always did (full logits, no loss)."""
    model, batch = _model("llama"), _batch()
    n = torch.tensor(31)
    want, _ = _loss_and_grads(model, batch, num_items_in_batch=n)
    plain = model(input_ids=batch["input_ids"])
    change = ChunkedLoss(ChunkedLoss.Config(4)).apply(model)
    got, _ = _loss_and_grads(model, batch, num_items_in_batch=n)
    without = model(input_ids=batch["input_ids"])
    change.remove()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=0)
    assert without.loss is None and torch.equal(without.logits, plain.logits)


def test_refuses_what_it_would_not_equal():
    with pytest.raises(ValueError, match="needs a causal LM with an output head"):
        ChunkedLoss(ChunkedLoss.Config()).apply(nn.Linear(4, 4))
    capped = _model("llama")
    capped.config.final_logit_softcapping = 30.0          # Gemma 2's
    with pytest.raises(ValueError, match="changes the logits after its head"):
        ChunkedLoss(ChunkedLoss.Config()).apply(capped)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="chunks must be an int >= 1"):
            ChunkedLoss.Config(bad)
    for bad in (-1, True, 1.5, "8"):
        with pytest.raises(ValueError, match="chunked_loss must be a number of pieces"):
            Knobs(chunked_loss=bad)
    Knobs(chunked_loss=0)                                  # off


BIG = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4)


def _big():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BIG))
    ids = torch.randint(0, 32000, (2, 256), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def _step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    optimizer.step()


def _real_peak(chunks: int | None) -> int:
    """A real CPU step counted by LiveBytes, the technique applied by hand (None: without)."""
    before = alive_storages()
    model, batch = _big()
    if chunks is not None:
        ChunkedLoss(ChunkedLoss.Config(chunks)).apply(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):                    # the optimizer's state made
        _step(model, optimizer, batch)
    with LiveBytes(device_tensors=job_tensors(before)) as live:
        _step(model, optimizer, batch)
    return live.peak_bytes


def test_estimate_is_the_real_step_and_the_peak_drops():
    model, batch = _big()
    plain = memfit.estimate(memfit.Job(model, batch), device="cpu")
    chunked = memfit.estimate(memfit.Job(model, batch), device="cpu", chunked_loss=8)
    assert chunked.peak_bytes == _real_peak(8)
    assert plain.peak_bytes == _real_peak(None)
    logits = 2 * 256 * 32000 * 4
    # the model's own loss holds the logits, their log-softmax and its gradient at once; eight
    # pieces hold an eighth of that
    assert plain.peak_bytes - chunked.peak_bytes > 2 * logits
    assert chunked.knobs.chunked_loss == 8
    assert any("chunked_loss=8" in n for n in memfit.fit(
        model, torch.optim.AdamW(model.parameters()), batch,
        chunked_loss=8).applied.notes)
