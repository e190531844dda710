"""The built-in models as plain data: real configs copied from the hub's config.json files.

``memfit.zoo`` builds a ``ModelSpec`` of each row (``zoo._registry``); ``memfit._zoo_names``
finds a row by name or alias. Neither this module nor that one imports torch or transformers
(a config class is named by its transformers name), so ``memfit models`` and the CLI's check
of ``--model`` answer without importing them.

Note 1 (what is copied). Each ``config_values`` dict copies the fields of the hub config.json
named in ``source`` that shape the model or its numerics (sizes, vocabulary, positions, norm
epsilons, dropouts, activation, special ids, tying, RoPE). Left out: ``architectures`` (the
``architectures`` map replaces it), ``model_type`` (the config class), ``torch_dtype`` (memfit
builds in float32 unless told), ``transformers_version``, label names (``num_labels`` keeps
their count) and generation-only ``task_specific_params``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["Row", "ROWS"]


class Row(NamedTuple):
    """One built-in model: the fields of ``memfit.zoo.ModelSpec``, its config class by name."""

    name: str                           # canonical name, e.g. "xlm-roberta-large"
    family: str                         # one of zoo.FAMILIES, e.g. "encoder"
    config_class: str                   # a transformers config class's name, e.g. "BertConfig"
    config_values: Mapping[str, Any]    # its keyword arguments, from config.json (Note 1)
    architectures: Mapping[str, str]    # task -> transformers class name
    default_task: str                   # the task used when none is given
    tiny_overrides: Mapping[str, Any] = {}   # config overrides of a tiny twin, for tests
    aliases: tuple[str, ...] = ()       # other names (hub ids, short names)
    source: str = ""                    # the hub repo whose config.json the values copy


def _encoder_tasks(prefix: str) -> dict[str, str]:
    return {"sequence-classification": f"{prefix}ForSequenceClassification",
            "token-classification": f"{prefix}ForTokenClassification",
            "masked-lm": f"{prefix}ForMaskedLM"}


# --- BERT / RoBERTa / XLM-R: post-norm encoders --------------------------------------------------
_BERT = dict(attention_probs_dropout_prob=0.1, hidden_act="gelu", hidden_dropout_prob=0.1, hidden_size=768,
             initializer_range=0.02, intermediate_size=3072, layer_norm_eps=1e-12, max_position_embeddings=512,
             num_attention_heads=12, num_hidden_layers=12, pad_token_id=0, position_embedding_type="absolute",
             type_vocab_size=2, vocab_size=30522)
_ROBERTA = dict(attention_probs_dropout_prob=0.1, bos_token_id=0, eos_token_id=2, hidden_act="gelu",
                hidden_dropout_prob=0.1, hidden_size=768, initializer_range=0.02, intermediate_size=3072,
                layer_norm_eps=1e-05, max_position_embeddings=514, num_attention_heads=12,
                num_hidden_layers=12, pad_token_id=1, type_vocab_size=1, vocab_size=50265)
_LARGE = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24)
_TINY_ENCODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                     vocab_size=128, max_position_embeddings=128)
# RoBERTa positions start at padding_idx + 1 = 2: 130 positions hold 128 tokens.
_TINY_ROBERTA = {**_TINY_ENCODER, "max_position_embeddings": 130}

# --- GPT-2: pre-norm decoder, learned positions, tied LM head ------------------------------------
_GPT2 = dict(activation_function="gelu_new", attn_pdrop=0.1, bos_token_id=50256, embd_pdrop=0.1,
             eos_token_id=50256, initializer_range=0.02, layer_norm_epsilon=1e-05, n_ctx=1024, n_embd=768,
             n_head=12, n_layer=12, n_positions=1024, resid_pdrop=0.1, summary_activation=None,
             summary_first_dropout=0.1, summary_proj_to_labels=True, summary_type="cls_index",
             summary_use_proj=True, vocab_size=50257)
_TINY_GPT2 = dict(n_embd=64, n_head=4, n_layer=2, n_positions=128, n_ctx=128, vocab_size=128, bos_token_id=127,
                  eos_token_id=127)

# --- Llama: RMSNorm, SwiGLU, RoPE ----------------------------------------------------------------
_LLAMA_3_2_1B = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=128000, eos_token_id=128001,
                     head_dim=64, hidden_act="silu", hidden_size=2048, initializer_range=0.02,
                     intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False,
                     num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8, pretraining_tp=1,
                     rms_norm_eps=1e-05,
                     rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                     rope_theta=500000.0, tie_word_embeddings=True, use_cache=True, vocab_size=128256)
_LLAMA_2_7B = dict(bos_token_id=1, eos_token_id=2, hidden_act="silu", hidden_size=4096, initializer_range=0.02,
                   intermediate_size=11008, max_position_embeddings=4096, num_attention_heads=32,
                   num_hidden_layers=32, num_key_value_heads=32, pretraining_tp=1, rms_norm_eps=1e-05,
                   rope_scaling=None, tie_word_embeddings=False, use_cache=True, vocab_size=32000)
_TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                   num_hidden_layers=2, vocab_size=128, max_position_embeddings=128)
_TINY_LLAMA_3 = {**_TINY_LLAMA, "num_key_value_heads": 2, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2,
                 "rope_scaling": {**_LLAMA_3_2_1B["rope_scaling"], "original_max_position_embeddings": 32}}

# --- Mistral / Qwen2.5: Llama-like decoders (GQA; Mistral's sliding window; Qwen's q/k/v biases) ----
_MISTRAL_7B = dict(attention_dropout=0.0, bos_token_id=1, eos_token_id=2, hidden_act="silu", hidden_size=4096,
                   initializer_range=0.02, intermediate_size=14336, max_position_embeddings=32768,
                   num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-05,
                   rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False, use_cache=True,
                   vocab_size=32000)
_QWEN2_5_7B = dict(attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643, hidden_act="silu",
                   hidden_size=3584, initializer_range=0.02, intermediate_size=18944, max_position_embeddings=131072,
                   max_window_layers=28, num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4,
                   rms_norm_eps=1e-06, rope_theta=1000000.0, sliding_window=131072, tie_word_embeddings=False,
                   use_cache=True, use_sliding_window=False, vocab_size=152064)
_TINY_DECODER = {**_TINY_LLAMA, "num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2}
_LLAMA_3_8B = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=128000, eos_token_id=128001,
                   hidden_act="silu", hidden_size=4096, initializer_range=0.02, intermediate_size=14336,
                   max_position_embeddings=8192, mlp_bias=False, num_attention_heads=32, num_hidden_layers=32,
                   num_key_value_heads=8, pretraining_tp=1, rms_norm_eps=1e-05, rope_scaling=None,
                   rope_theta=500000.0, tie_word_embeddings=False, use_cache=True, vocab_size=128256)
_GEMMA_2_2B = dict(attention_bias=False, attention_dropout=0.0, attn_logit_softcapping=50.0, bos_token_id=2,
                   eos_token_id=1, final_logit_softcapping=30.0, head_dim=256,
                   hidden_activation="gelu_pytorch_tanh", hidden_size=2304, initializer_range=0.02,
                   intermediate_size=9216, max_position_embeddings=8192, num_attention_heads=8,
                   num_hidden_layers=26, num_key_value_heads=4, pad_token_id=0, query_pre_attn_scalar=256,
                   rms_norm_eps=1e-06, rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=True,
                   vocab_size=256000)
_TINY_GEMMA_2 = {**_TINY_DECODER, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
                 "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
_PHI_3_MINI = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=1, embd_pdrop=0.0, eos_token_id=32000,
                   hidden_act="silu", hidden_size=3072, initializer_range=0.02, intermediate_size=8192,
                   max_position_embeddings=4096, num_attention_heads=32, num_hidden_layers=32,
                   num_key_value_heads=32, original_max_position_embeddings=4096, pad_token_id=32000,
                   resid_pdrop=0.0, rms_norm_eps=1e-05, rope_scaling=None, rope_theta=10000.0,
                   sliding_window=2047, tie_word_embeddings=False, use_cache=True, vocab_size=32064)
_TINY_PHI_3 = {**_TINY_DECODER, "original_max_position_embeddings": 128, "sliding_window": 8, "pad_token_id": 0,
               "eos_token_id": 2}
_QWEN1_5_MOE = dict(attention_dropout=0.0, bos_token_id=151643, decoder_sparse_step=1, eos_token_id=151643,
                    hidden_act="silu", hidden_size=2048, initializer_range=0.02, intermediate_size=5632,
                    max_position_embeddings=8192, max_window_layers=21, moe_intermediate_size=1408,
                    norm_topk_prob=False, num_attention_heads=16, num_experts=60, num_experts_per_tok=4,
                    num_hidden_layers=24, num_key_value_heads=16, output_router_logits=False,
                    rms_norm_eps=1e-06, rope_theta=1000000.0, router_aux_loss_coef=0.001,
                    shared_expert_intermediate_size=5632, sliding_window=32768, tie_word_embeddings=False,
                    use_cache=True, use_sliding_window=False, vocab_size=151936)
_TINY_MOE = {**_TINY_DECODER, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4,
             "num_experts_per_tok": 2}

# --- DeBERTa-v3 and ModernBERT: encoders with relative / rotary positions --------------------------
_DEBERTA_V3_BASE = dict(attention_probs_dropout_prob=0.1, hidden_act="gelu", hidden_dropout_prob=0.1,
                        hidden_size=768, initializer_range=0.02, intermediate_size=3072, layer_norm_eps=1e-07,
                        max_position_embeddings=512, max_relative_positions=-1, norm_rel_ebd="layer_norm",
                        num_attention_heads=12, num_hidden_layers=12, pad_token_id=0, pooler_dropout=0,
                        pooler_hidden_act="gelu", pooler_hidden_size=768, pos_att_type=["p2c", "c2p"],
                        position_biased_input=False, position_buckets=256, relative_attention=True,
                        share_att_key=True, type_vocab_size=0, vocab_size=128100)
_TINY_DEBERTA = {**_TINY_ENCODER, "pooler_hidden_size": 64, "position_buckets": 16}
_MODERNBERT_BASE = dict(attention_bias=False, attention_dropout=0.0, bos_token_id=50281, classifier_activation="gelu",
                        cls_token_id=50281, embedding_dropout=0.0, eos_token_id=50282, global_attn_every_n_layers=3,
                        global_rope_theta=160000.0, hidden_activation="gelu", hidden_size=768,
                        initializer_range=0.02, intermediate_size=1152, local_attention=128,
                        local_rope_theta=10000.0, max_position_embeddings=8192, mlp_bias=False, mlp_dropout=0.0,
                        norm_bias=False, norm_eps=1e-05, num_attention_heads=12, num_hidden_layers=22,
                        pad_token_id=50283, sep_token_id=50282, vocab_size=50368)
_TINY_MODERNBERT = {**_TINY_ENCODER, "num_hidden_layers": 3, "local_attention": 8, "bos_token_id": 1,
                    "cls_token_id": 1, "eos_token_id": 2, "sep_token_id": 2, "pad_token_id": 0}

# --- Whisper (speech seq2seq) and CLIP (contrastive image-text) -----------------------------------
_WHISPER_SMALL = dict(activation_dropout=0.0, activation_function="gelu", attention_dropout=0.0, bos_token_id=50257,
                      d_model=768, decoder_attention_heads=12, decoder_ffn_dim=3072, decoder_layers=12,
                      decoder_start_token_id=50258, dropout=0.0, encoder_attention_heads=12, encoder_ffn_dim=3072,
                      encoder_layers=12, eos_token_id=50257, max_source_positions=1500, max_target_positions=448,
                      num_mel_bins=80, pad_token_id=50257, scale_embedding=False, vocab_size=51865)
_TINY_WHISPER = dict(d_model=64, decoder_attention_heads=4, decoder_ffn_dim=128, decoder_layers=2,
                     encoder_attention_heads=4, encoder_ffn_dim=128, encoder_layers=2, num_mel_bins=16,
                     max_source_positions=32, max_target_positions=64, vocab_size=128, bos_token_id=1,
                     eos_token_id=2, pad_token_id=2, decoder_start_token_id=3)
_CLIP_B32 = dict(projection_dim=512, logit_scale_init_value=2.6592,
                 text_config=dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8,
                                  num_hidden_layers=12, max_position_embeddings=77, vocab_size=49408,
                                  hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407, pad_token_id=1),
                 vision_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                    num_hidden_layers=12, image_size=224, patch_size=32, hidden_act="quick_gelu"))
_TINY_CLIP = dict(projection_dim=32,
                  text_config=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                                   max_position_embeddings=32, vocab_size=128, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0),
                  vision_config=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                     num_hidden_layers=2, image_size=32, patch_size=8))

# --- T5 v1.0: encoder-decoder, relative position buckets, tied LM head ---------------------------
_T5_BASE = dict(d_ff=3072, d_kv=64, d_model=768, decoder_start_token_id=0, dropout_rate=0.1, eos_token_id=1,
                initializer_factor=1.0, is_encoder_decoder=True, layer_norm_epsilon=1e-06, n_positions=512,
                num_heads=12, num_layers=12, output_past=True, pad_token_id=0,
                relative_attention_num_buckets=32, vocab_size=32128)
_TINY_T5 = dict(d_ff=128, d_kv=16, d_model=64, num_heads=4, num_layers=2, vocab_size=128)

# --- Vision --------------------------------------------------------------------------------------
_VIT = dict(attention_probs_dropout_prob=0.0, hidden_act="gelu", hidden_dropout_prob=0.0, hidden_size=768,
            image_size=224, initializer_range=0.02, intermediate_size=3072, layer_norm_eps=1e-12,
            num_attention_heads=12, num_channels=3, num_hidden_layers=12, num_labels=1000, patch_size=16,
            qkv_bias=True)
_TINY_VIT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                 image_size=32, patch_size=8, num_labels=10)
_CONVNEXT_TINY = dict(depths=[3, 3, 9, 3], drop_path_rate=0.0, hidden_act="gelu", hidden_sizes=[96, 192, 384, 768],
                      image_size=224, layer_norm_eps=1e-12, layer_scale_init_value=1e-06, num_channels=3,
                      num_labels=1000, patch_size=4)
_TINY_CONVNEXT = dict(depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 64, 128], num_labels=10, image_size=32)
_SWIN_TINY = dict(attention_probs_dropout_prob=0.0, depths=[2, 2, 6, 2], drop_path_rate=0.1, embed_dim=96,
                  hidden_act="gelu", hidden_dropout_prob=0.0, image_size=224, layer_norm_eps=1e-05, mlp_ratio=4.0,
                  num_channels=3, num_heads=[3, 6, 12, 24], num_labels=1000, patch_size=4, qkv_bias=True,
                  window_size=7)
_TINY_SWIN = dict(depths=[1, 1], embed_dim=16, num_heads=[2, 4], image_size=32, patch_size=2, window_size=4,
                  num_labels=10)
_RESNET_50 = dict(depths=[3, 4, 6, 3], downsample_in_first_stage=False, embedding_size=64, hidden_act="relu",
                  hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck", num_channels=3, num_labels=1000)
_TINY_RESNET = dict(depths=[1, 1, 1, 1], embedding_size=8, hidden_sizes=[16, 32, 64, 128], num_labels=10)


def _rows() -> tuple[Row, ...]:
    """Every built-in model, in the order ``memfit.zoo.names()`` lists them."""
    enc = "encoder"
    return (
        Row("bert-base", enc, "BertConfig", _BERT, _encoder_tasks("Bert"), "sequence-classification",
            _TINY_ENCODER, ("bert-base-uncased", "google-bert/bert-base-uncased"),
            "google-bert/bert-base-uncased"),
        Row("bert-large", enc, "BertConfig", {**_BERT, **_LARGE}, _encoder_tasks("Bert"),
            "sequence-classification", _TINY_ENCODER,
            ("bert-large-uncased", "google-bert/bert-large-uncased"), "google-bert/bert-large-uncased"),
        Row("roberta-base", enc, "RobertaConfig", _ROBERTA, _encoder_tasks("Roberta"),
            "sequence-classification", _TINY_ROBERTA, ("FacebookAI/roberta-base",), "FacebookAI/roberta-base"),
        Row("roberta-large", enc, "RobertaConfig", {**_ROBERTA, **_LARGE}, _encoder_tasks("Roberta"),
            "sequence-classification", _TINY_ROBERTA, ("FacebookAI/roberta-large",),
            "FacebookAI/roberta-large"),
        Row("xlm-roberta-base", enc, "XLMRobertaConfig", {**_ROBERTA, "vocab_size": 250002, "output_past": True},
            _encoder_tasks("XLMRoberta"), "sequence-classification", _TINY_ROBERTA,
            ("FacebookAI/xlm-roberta-base", "xlmr-base"), "FacebookAI/xlm-roberta-base"),
        Row("xlm-roberta-large", enc, "XLMRobertaConfig",
            {**_ROBERTA, **_LARGE, "vocab_size": 250002, "output_past": True},
            _encoder_tasks("XLMRoberta"), "sequence-classification", _TINY_ROBERTA,
            ("FacebookAI/xlm-roberta-large", "xlmr-large"), "FacebookAI/xlm-roberta-large"),
        *(_gpt2(name, size) for name, size in (("gpt2", {}), ("gpt2-medium", dict(n_embd=1024, n_head=16, n_layer=24)),
                                               ("gpt2-large", dict(n_embd=1280, n_head=20, n_layer=36)),
                                               ("gpt2-xl", dict(n_embd=1600, n_head=25, n_layer=48)))),
        Row("llama-1b", "causal-lm", "LlamaConfig", _LLAMA_3_2_1B, {"causal-lm": "LlamaForCausalLM"},
            "causal-lm", _TINY_LLAMA_3, ("meta-llama/Llama-3.2-1B", "llama-3.2-1b", "llama3.2-1b"),
            "meta-llama/Llama-3.2-1B"),
        Row("llama-7b", "causal-lm", "LlamaConfig", _LLAMA_2_7B, {"causal-lm": "LlamaForCausalLM"},
            "causal-lm", _TINY_LLAMA, ("meta-llama/Llama-2-7b-hf", "llama-2-7b", "llama2-7b"),
            "meta-llama/Llama-2-7b-hf"),
        Row("llama-3-8b", "causal-lm", "LlamaConfig", _LLAMA_3_8B, {"causal-lm": "LlamaForCausalLM"},
            "causal-lm", _TINY_LLAMA_3, ("meta-llama/Meta-Llama-3-8B", "llama3-8b"),
            "meta-llama/Meta-Llama-3-8B"),
        Row("mistral-7b", "causal-lm", "MistralConfig", _MISTRAL_7B, {"causal-lm": "MistralForCausalLM"},
            "causal-lm", {**_TINY_DECODER, "sliding_window": 8},
            ("mistralai/Mistral-7B-v0.1", "mistral-7b-v0.1"), "mistralai/Mistral-7B-v0.1"),
        Row("qwen2.5-7b", "causal-lm", "Qwen2Config", _QWEN2_5_7B, {"causal-lm": "Qwen2ForCausalLM"},
            "causal-lm", _TINY_DECODER, ("Qwen/Qwen2.5-7B", "qwen2.5"), "Qwen/Qwen2.5-7B"),
        Row("gemma-2-2b", "causal-lm", "Gemma2Config", _GEMMA_2_2B, {"causal-lm": "Gemma2ForCausalLM"},
            "causal-lm", _TINY_GEMMA_2, ("google/gemma-2-2b", "gemma2-2b"), "google/gemma-2-2b"),
        Row("phi-3-mini", "causal-lm", "Phi3Config", _PHI_3_MINI, {"causal-lm": "Phi3ForCausalLM"},
            "causal-lm", _TINY_PHI_3, ("microsoft/Phi-3-mini-4k-instruct", "phi3-mini"),
            "microsoft/Phi-3-mini-4k-instruct"),
        Row("qwen1.5-moe-a2.7b", "causal-lm", "Qwen2MoeConfig", _QWEN1_5_MOE,
            {"causal-lm": "Qwen2MoeForCausalLM"}, "causal-lm", _TINY_MOE,
            ("Qwen/Qwen1.5-MoE-A2.7B", "qwen2-moe"), "Qwen/Qwen1.5-MoE-A2.7B"),
        Row("deberta-v3-base", enc, "DebertaV2Config", _DEBERTA_V3_BASE, _encoder_tasks("DebertaV2"),
            "sequence-classification", _TINY_DEBERTA, ("microsoft/deberta-v3-base",),
            "microsoft/deberta-v3-base"),
        Row("modernbert-base", enc, "ModernBertConfig", _MODERNBERT_BASE, _encoder_tasks("ModernBert"),
            "sequence-classification", _TINY_MODERNBERT, ("answerdotai/ModernBERT-base",),
            "answerdotai/ModernBERT-base"),
        Row("t5-base", "seq2seq", "T5Config", _T5_BASE, {"seq2seq-lm": "T5ForConditionalGeneration"},
            "seq2seq-lm", _TINY_T5, ("google-t5/t5-base",), "google-t5/t5-base"),
        Row("whisper-small", "seq2seq", "WhisperConfig", _WHISPER_SMALL,
            {"speech-seq2seq": "WhisperForConditionalGeneration"}, "speech-seq2seq", _TINY_WHISPER,
            ("openai/whisper-small",), "openai/whisper-small"),
        Row("clip-vit-base-patch32", "multimodal", "CLIPConfig", _CLIP_B32, {"contrastive": "CLIPModel"},
            "contrastive", _TINY_CLIP, ("openai/clip-vit-base-patch32", "clip-base"),
            "openai/clip-vit-base-patch32"),
        Row("vit-base", "vision", "ViTConfig", _VIT, {"image-classification": "ViTForImageClassification"},
            "image-classification", _TINY_VIT, ("google/vit-base-patch16-224", "vit-base-patch16-224"),
            "google/vit-base-patch16-224"),
        Row("vit-large", "vision", "ViTConfig", {**_VIT, **_LARGE},
            {"image-classification": "ViTForImageClassification"}, "image-classification", _TINY_VIT,
            ("google/vit-large-patch16-224", "vit-large-patch16-224"), "google/vit-large-patch16-224"),
        Row("convnext-tiny", "vision", "ConvNextConfig", _CONVNEXT_TINY,
            {"image-classification": "ConvNextForImageClassification"}, "image-classification", _TINY_CONVNEXT,
            ("facebook/convnext-tiny-224",), "facebook/convnext-tiny-224"),
        Row("swin-tiny", "vision", "SwinConfig", _SWIN_TINY, {"image-classification": "SwinForImageClassification"},
            "image-classification", _TINY_SWIN, ("microsoft/swin-tiny-patch4-window7-224",),
            "microsoft/swin-tiny-patch4-window7-224"),
        Row("resnet-50", "vision", "ResNetConfig", _RESNET_50,
            {"image-classification": "ResNetForImageClassification"}, "image-classification", _TINY_RESNET,
            ("microsoft/resnet-50", "resnet50"), "microsoft/resnet-50"),
    )


def _gpt2(name: str, size: dict) -> Row:
    hub = f"openai-community/{name}"
    aliases = (hub, "gpt2-small") if name == "gpt2" else (hub,)
    return Row(name, "causal-lm", "GPT2Config", {**_GPT2, **size}, {"causal-lm": "GPT2LMHeadModel"},
               "causal-lm", _TINY_GPT2, aliases, hub)


ROWS: tuple[Row, ...] = _rows()
