"""Architectures people train today, tiny and random (their real transformers config classes, no
hub): memfit.estimate equals memfit.track to the byte on one real CPU training step."""

import pytest
import torch
import transformers as T

import memfit
from memfit import zoo
from tests.helpers import track_real_step

_DECODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=128, max_position_embeddings=128, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
_VISION_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2)

CONFIGS = {  # name -> (config class, kwargs, architecture)
    "llama-3": (T.LlamaConfig, {**_DECODER, "head_dim": 16, "rope_theta": 500000.0}, "LlamaForCausalLM"),
    "mistral": (T.MistralConfig, {**_DECODER, "sliding_window": 8}, "MistralForCausalLM"),
    "qwen2.5": (T.Qwen2Config, {**_DECODER, "tie_word_embeddings": True}, "Qwen2ForCausalLM"),
    "gemma-2": (T.Gemma2Config, {**_DECODER, "head_dim": 16, "sliding_window": 8}, "Gemma2ForCausalLM"),
    "phi-3": (T.Phi3Config, _DECODER, "Phi3ForCausalLM"),
    "qwen2-moe": (T.Qwen2MoeConfig, {**_DECODER, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                                     "num_experts": 4, "num_experts_per_tok": 2}, "Qwen2MoeForCausalLM"),
    "deberta-v3": (T.DebertaV2Config, {**_VISION_TEXT, "vocab_size": 128, "max_position_embeddings": 128,
                                       "relative_attention": True, "position_buckets": 16,
                                       "pos_att_type": ["p2c", "c2p"], "norm_rel_ebd": "layer_norm",
                                       "share_att_key": True, "position_biased_input": False,
                                       "max_relative_positions": -1, "type_vocab_size": 0},
                   "DebertaV2ForSequenceClassification"),
    "modernbert": (T.ModernBertConfig, {**_VISION_TEXT, "num_hidden_layers": 3, "vocab_size": 128,
                                        "max_position_embeddings": 128, "global_attn_every_n_layers": 3,
                                        "local_attention": 8, "pad_token_id": 0, "bos_token_id": 1,
                                        "eos_token_id": 2, "sep_token_id": 2, "cls_token_id": 1,
                                        "mask_token_id": 3}, "ModernBertForMaskedLM"),
    "whisper": (T.WhisperConfig, dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                      decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                      vocab_size=128, num_mel_bins=16, max_source_positions=32,
                                      max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      decoder_start_token_id=1), "WhisperForConditionalGeneration"),
    "clip": (T.CLIPConfig, dict(text_config={**_VISION_TEXT, "vocab_size": 128, "max_position_embeddings": 32,
                                             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
                                vision_config={**_VISION_TEXT, "image_size": 32, "patch_size": 8},
                                projection_dim=32), "CLIPModel"),
    "convnext": (T.ConvNextConfig, dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1], num_labels=10,
                                        image_size=32), "ConvNextForImageClassification"),
    "swin": (T.SwinConfig, dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                window_size=4, num_labels=10), "SwinForImageClassification"),
}


def spec_of(name, tmp_path):
    """The spec memfit builds from the architecture's config.json (as `memfit --config` does)."""
    cls, kwargs, arch = CONFIGS[name]
    cls(**kwargs, architectures=[arch]).save_pretrained(tmp_path)
    return zoo.from_config_file(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_equals_track(name, tmp_path):
    spec = spec_of(name, tmp_path)
    model = spec.build()
    batch = spec.make_batch(model, 2, seq_len=None if spec.family == "vision" else 16)
    est = memfit.estimate(model, batch, optimizer="adamw")
    t = track_real_step(model, batch, "adamw")
    assert (est.peak_bytes, est.breakdown) == (t.peak_bytes, t.breakdown)


@pytest.mark.parametrize("name,task,keys", [
    ("whisper", "speech-seq2seq", {"input_features", "labels"}),
    ("clip", "contrastive", {"input_ids", "attention_mask", "pixel_values", "return_loss"}),
])
def test_usual_heads_are_known(name, task, keys, tmp_path):
    spec = spec_of(name, tmp_path)
    assert spec.default_task == task
    model = spec.build()
    batch = spec.make_batch(model, 2)
    assert set(batch) == keys
    assert torch.isfinite(model(**batch).loss)


def test_a_bare_model_config_trains_with_its_family_head(tmp_path):
    T.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=64,
                 architectures=["BartModel"]).save_pretrained(tmp_path)
    spec = zoo.from_config_file(tmp_path)
    assert spec.default_task == "seq2seq-lm"
    assert type(spec.build(device="meta")).__name__ == "BartForConditionalGeneration"


def test_moe_in_fp32_needs_no_bf16_pure(tmp_path):
    spec = spec_of("qwen2-moe", tmp_path)
    model = spec.build()
    batch = spec.make_batch(model, 2, seq_len=16)
    for precision in ("fp32", "bf16"):
        est = memfit.estimate(model, batch, optimizer="sgd", precision=precision)
        assert est.peak_bytes == track_real_step(model, batch, "sgd", precision).peak_bytes


@pytest.mark.parametrize("name", ["modernbert", "swin"])
def test_estimate_equals_track_under_bf16_autocast(name, tmp_path):
    """Their norms get a bf16 input with fp32 parameters (fidelity Rule 4)."""
    spec = spec_of(name, tmp_path)
    model = spec.build()
    batch = spec.make_batch(model, 2, seq_len=None if spec.family == "vision" else 16)
    est = memfit.estimate(model, batch, optimizer="adamw", precision="bf16")
    t = track_real_step(model, batch, "adamw", "bf16")
    assert (est.peak_bytes, est.breakdown) == (t.peak_bytes, t.breakdown)
