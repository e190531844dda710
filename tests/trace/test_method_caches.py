"""A trace leaves no fake in the model's own method caches (trace._method_caches).

transformers' BEiT caches its relative position index per window size in an ``lru_cache`` its
class holds: built inside a trace it was a fake, so a second estimate failed ("Mixing fake
modes") and so did a real step after the estimate."""

import torch
import transformers as T

import memfit


def _beit():
    cfg = T.BeitConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       use_relative_position_bias=True, num_labels=3)
    torch.manual_seed(0)
    model = T.BeitForImageClassification(cfg)
    return model, {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([0, 2])}


def test_estimate_twice_then_a_real_step():
    model, batch = _beit()
    first = memfit.estimate(memfit.Job(model, batch)).peak_bytes
    assert memfit.estimate(memfit.Job(model, batch), device="rtx-4090").peak_bytes > 0
    assert memfit.estimate(memfit.Job(model, batch)).peak_bytes == first
    model(**batch).loss.backward()                 # real tensors only: nothing fake is cached
    assert all(p.grad is not None and not isinstance(p.grad, torch._subclasses.FakeTensor)
               for p in model.parameters() if p.requires_grad)
