"""memfit.zoo: real configs (checked by exact parameter counts), tiny twins that train, batches, errors.

Full-size models are built only on the meta device. Expected parameter counts are derived by
hand from the architecture (the `_*_params` formulas below, each a sum of weight shapes) and
each formula is pinned to the figure the model's publishers or `model.num_parameters()` on the
hub checkpoint report, so a wrong config value shows up as a mismatch of exact ints.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from memfit import zoo
from memfit.zoo import ModelSpec, count_parameters

ALL_TASKS = [(name, task) for name in zoo.names() for task in zoo.get(name).tasks]


# --- hand-derived parameter counts -------------------------------------------------------------
def _post_norm_layer(d: int, ff: int) -> int:
    """BERT/RoBERTa/ViT layer: q,k,v,o (d*d + d each), two LayerNorms, FFN d->ff->d with biases."""
    return 4 * (d * d + d) + 2 * 2 * d + (d * ff + ff) + (ff * d + d)


def _bert_model_params(vocab: int, positions: int, types: int, d: int, ff: int, layers: int) -> int:
    """BertModel/RobertaModel with pooler: embeddings + LN, layers, pooler dense d*d + d."""
    return (vocab + positions + types) * d + 2 * d + layers * _post_norm_layer(d, ff) + d * d + d


def _gpt2_params(vocab: int, positions: int, d: int, layers: int) -> int:
    """GPT2LMHeadModel (head tied to wte): wte, wpe, per layer 2 LN + c_attn + c_proj + 4d MLP, ln_f."""
    layer = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return (vocab + positions) * d + layers * layer + 2 * d


def _llama_params(vocab: int, d: int, ff: int, layers: int, heads: int, kv_heads: int, tied: bool) -> int:
    """LlamaForCausalLM: embed, per layer q/o (d*d), k/v (d*kv*hd), gate/up/down (3*d*ff), 2 RMSNorm; norm; head."""
    kv = d // heads * kv_heads
    layer = 2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d
    return vocab * d * (1 if tied else 2) + layers * layer + d


def _t5_params(vocab: int, d: int, ff: int, layers: int, heads: int, buckets: int) -> int:
    """T5ForConditionalGeneration v1.0 (head tied to shared): no biases, relative bias in layer 0 only."""
    attn, ffn = 4 * d * d, 2 * d * ff
    encoder = layers * (attn + ffn + 2 * d) + buckets * heads + d
    decoder = layers * (2 * attn + ffn + 3 * d) + buckets * heads + d
    return vocab * d + encoder + decoder


def _vit_model_params(image: int, patch: int, d: int, ff: int, layers: int, pooler: bool) -> int:
    """ViTModel: patch conv (3*p*p*d + d), CLS token, positions, layers, final LN, optional pooler."""
    tokens = (image // patch) ** 2 + 1
    return (3 * patch * patch * d + d) + d + tokens * d + layers * _post_norm_layer(d, ff) + 2 * d + (
        d * d + d if pooler else 0)


# Published figures each formula must reproduce (model.num_parameters() of the hub checkpoints;
# model cards / papers give the rounded 110M, 340M, 125M, 355M, 270M, 550M, 124M, 355M, 774M, 1.5B,
# 1.23B, 6.7B, 220M, 86M, 304M, 25.6M).
PUBLISHED = {
    "bert-base-uncased BertModel": (_bert_model_params(30522, 512, 2, 768, 3072, 12), 109_482_240),
    "bert-large-uncased BertModel": (_bert_model_params(30522, 512, 2, 1024, 4096, 24), 335_141_888),
    "roberta-base RobertaModel": (_bert_model_params(50265, 514, 1, 768, 3072, 12), 124_645_632),
    "roberta-large RobertaModel": (_bert_model_params(50265, 514, 1, 1024, 4096, 24), 355_359_744),
    "xlm-roberta-base XLMRobertaModel": (_bert_model_params(250002, 514, 1, 768, 3072, 12), 278_043_648),
    "xlm-roberta-large XLMRobertaModel": (_bert_model_params(250002, 514, 1, 1024, 4096, 24), 559_890_432),
    "gpt2": (_gpt2_params(50257, 1024, 768, 12), 124_439_808),
    "gpt2-medium": (_gpt2_params(50257, 1024, 1024, 24), 354_823_168),
    "gpt2-large": (_gpt2_params(50257, 1024, 1280, 36), 774_030_080),
    "gpt2-xl": (_gpt2_params(50257, 1024, 1600, 48), 1_557_611_200),
    "Llama-3.2-1B": (_llama_params(128256, 2048, 8192, 16, 32, 8, tied=True), 1_235_814_400),
    "Llama-2-7b": (_llama_params(32000, 4096, 11008, 32, 32, 32, tied=False), 6_738_415_616),
    "t5-base": (_t5_params(32128, 768, 3072, 12, 12, 32), 222_903_552),
    "vit-base-patch16-224 ViTModel": (_vit_model_params(224, 16, 768, 3072, 12, pooler=True), 86_389_248),
    "vit-large-patch16-224 ViTModel": (_vit_model_params(224, 16, 1024, 4096, 24, pooler=True), 304_351_232),
}


@pytest.mark.parametrize("label", list(PUBLISHED))
def test_formulas_reproduce_published_counts(label):
    formula, published = PUBLISHED[label]
    assert formula == published


def _cls_head(d: int, labels: int) -> int:
    return d * labels + labels


# (zoo name, task, expected count of the model spec.build(task) returns, how it is derived)
FULL_SIZE = [
    ("bert-base", "sequence-classification", 109_482_240 + _cls_head(768, 2)),  # BertModel + linear
    # BertForMaskedLM: no pooler, but a transform dense of the pooler's size, its LayerNorm and the
    # decoder bias (decoder weight tied to the word embeddings): 109,514,298
    ("bert-base", "masked-lm", 109_482_240 + 2 * 768 + 30522),
    ("bert-large", "sequence-classification", 335_141_888 + _cls_head(1024, 2)),
    # Roberta*ForSequenceClassification: no pooler; head dense d->d then out_proj d->2
    ("roberta-base", "sequence-classification", 124_645_632 - 590_592 + _cls_head(768, 768) + _cls_head(768, 2)),
    ("roberta-large", "sequence-classification",
     355_359_744 - 1_049_600 + _cls_head(1024, 1024) + _cls_head(1024, 2)),
    ("xlm-roberta-base", "sequence-classification",
     278_043_648 - 590_592 + _cls_head(768, 768) + _cls_head(768, 2)),
    ("xlm-roberta-large", "sequence-classification",
     559_890_432 - 1_049_600 + _cls_head(1024, 1024) + _cls_head(1024, 2)),
    ("xlm-roberta-large", "token-classification", 559_890_432 - 1_049_600 + _cls_head(1024, 2)),
    ("gpt2", "causal-lm", 124_439_808),
    ("gpt2-medium", "causal-lm", 354_823_168),
    ("gpt2-large", "causal-lm", 774_030_080),
    ("gpt2-xl", "causal-lm", 1_557_611_200),
    ("llama-1b", "causal-lm", 1_235_814_400),
    ("llama-7b", "causal-lm", 6_738_415_616),
    ("t5-base", "seq2seq-lm", 222_903_552),
    # ViTForImageClassification: ViTModel without pooler + 1000-way classifier
    ("vit-base", "image-classification", 86_389_248 - 590_592 + _cls_head(768, 1000)),  # 86,567,656
    ("vit-large", "image-classification", 304_351_232 - 1_049_600 + _cls_head(1024, 1000)),  # 304,326,632
    # torchvision resnet50 has the same layers (bias-free convs, BN affine, fc): 25,557,032
    ("resnet-50", "image-classification", 25_557_032),
]


@pytest.mark.parametrize("name,task,expected", FULL_SIZE, ids=[f"{n}-{t}" for n, t, _ in FULL_SIZE])
def test_full_size_parameter_count_on_meta(name, task, expected):
    model = zoo.get(name).build(task, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert count_parameters(model) == expected


def test_llama_configs_keep_structural_switches():
    llama3 = zoo.get("llama-1b").config()
    assert llama3.tie_word_embeddings and llama3.num_key_value_heads == 8 and llama3.head_dim == 64
    assert llama3.max_position_embeddings == 131072
    assert llama3.rope_parameters["rope_type"] == "llama3" and llama3.rope_parameters["rope_theta"] == 500000.0
    llama2 = zoo.get("llama-7b").config()
    assert not llama2.tie_word_embeddings and llama2.num_key_value_heads == 32
    tiny3 = zoo.get("llama-1b").config(tiny=True)
    assert tiny3.tie_word_embeddings and tiny3.num_key_value_heads < tiny3.num_attention_heads  # still GQA
    assert tiny3.rope_parameters["rope_type"] == "llama3"


# --- tiny twins train ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,task", ALL_TASKS, ids=[f"{n}-{t}" for n, t in ALL_TASKS])
def test_tiny_model_trains_on_its_batches(name, task):
    spec = zoo.get(name)
    model = spec.build(task, tiny=True)
    assert isinstance(model, spec.model_class(task)) and model.training
    assert count_parameters(model) < 500_000
    vision = spec.family == "vision"
    for padded in (False,) if vision else (False, True):
        size = dict(image_size=32) if vision else dict(seq_len=16, padded=padded)
        batch = spec.make_batch(model, 3, **size)
        assert all(v.shape[0] == 3 for v in batch.values() if isinstance(v, torch.Tensor))
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        if not vision:
            text = model.text_model if spec.family == "multimodal" else model
            assert text.get_input_embeddings().weight.grad is not None


def test_build_is_seeded_sdpa_and_leaves_global_rng_alone():
    spec = zoo.get("bert-base")
    state = torch.random.get_rng_state()
    a, b = spec.build(tiny=True, seed=1), spec.build(tiny=True, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    c = spec.build(tiny=True, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.bert.embeddings.word_embeddings.weight, c.bert.embeddings.word_embeddings.weight)
    assert a.config._attn_implementation == "sdpa"
    half = spec.build(tiny=True, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in a.parameters()} == {torch.float32}


def test_count_parameters_counts_tied_weights_once():
    model = zoo.get("gpt2").build(tiny=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    with_duplicates = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert count_parameters(model) == with_duplicates - model.lm_head.weight.numel()


# --- batches ------------------------------------------------------------------------------------
def test_padded_text_batch_layout():
    spec = zoo.get("bert-base")
    config = spec.config(tiny=True)
    batch = spec.make_batch(config, 5, seq_len=20, padded=True, task="token-classification", seed=3)
    lengths = batch["attention_mask"].sum(1)
    assert lengths.tolist() == [20, 18, 15, 13, 10]  # Note 2 of _batches: 20 - i*10//4
    pad = ~batch["attention_mask"].bool()
    assert (batch["input_ids"][pad] == config.pad_token_id).all()
    assert (batch["labels"][pad] == -100).all() and (batch["labels"][~pad] >= 0).all()
    assert batch["token_type_ids"].shape == (5, 20)
    again = spec.make_batch(config, 5, seq_len=20, padded=True, task="token-classification", seed=3)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    unpadded = spec.make_batch(config, 5, seq_len=20, task="sequence-classification")
    assert unpadded["attention_mask"].all() and unpadded["labels"].shape == (5,)


def test_text_batches_per_task():
    roberta = zoo.get("roberta-base")
    mlm = roberta.make_batch(roberta.config(), 8, seq_len=256, padded=True, task="masked-lm")
    assert "token_type_ids" not in mlm  # RoBERTa has a single token type
    picked = mlm["labels"] != -100
    assert torch.equal(mlm["labels"][picked], mlm["input_ids"][picked])
    assert (mlm["attention_mask"].bool() | ~picked).all()
    assert 0.10 < picked.sum() / mlm["attention_mask"].sum() < 0.20
    low, high = 3, 50265  # roberta: bos 0, pad 1, eos 2
    real = mlm["input_ids"][mlm["attention_mask"].bool()]
    assert real.min() >= low and real.max() < high

    gpt2 = zoo.get("gpt2")
    lm = gpt2.make_batch(gpt2.config(), 2)
    assert lm["input_ids"].shape == (2, 256) and torch.equal(lm["labels"], lm["input_ids"])
    assert lm["input_ids"].max() < 50256  # never the <|endoftext|> id
    assert gpt2.make_batch(gpt2.config(tiny=True), 2)["input_ids"].shape == (2, 128)  # min(256, n_positions)

    t5 = zoo.get("t5-base")
    s2s = t5.make_batch(t5.config(), 4, seq_len=64, padded=True)
    assert s2s["labels"].shape == (4, 16) and (s2s["labels"][-1] == -100).any()


def test_image_batches():
    vit, resnet = zoo.get("vit-base"), zoo.get("resnet-50")
    batch = vit.make_batch(vit.config(), 2)
    assert batch["pixel_values"].shape == (2, 3, 224, 224) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].max() < 1000
    assert resnet.make_batch(resnet.config(), 2)["pixel_values"].shape == (2, 3, 224, 224)
    assert resnet.make_batch(resnet.config(), 2, image_size=64)["pixel_values"].shape == (2, 3, 64, 64)
    model = vit.build(tiny=True, image_size=48)  # a new size needs a model built for it
    assert torch.isfinite(model(**vit.make_batch(model, 2, image_size=48)).loss)
    with pytest.raises(ValueError, match=r"built for 224x224.*spec.build\(..., image_size=64\)"):
        vit.make_batch(vit.config(), 2, image_size=64)
    with pytest.raises(ValueError, match="not a multiple of .*patch_size 16: use e.g. 96 or 112"):
        vit.make_batch(vit.config(), 2, image_size=100)


def test_meta_batch():
    spec = zoo.get("llama-7b")
    batch = spec.make_batch(spec.config(), 4, seq_len=4096, device="meta")
    assert batch["input_ids"].device.type == "meta" and batch["input_ids"].shape == (4, 4096)


# --- errors -------------------------------------------------------------------------------------
def test_lookup_by_alias_and_case():
    assert zoo.names() == ["bert-base", "bert-large", "roberta-base", "roberta-large", "xlm-roberta-base",
                           "xlm-roberta-large", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-1b",
                           "llama-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b", "gemma-2-2b", "phi-3-mini",
                           "qwen1.5-moe-a2.7b", "deberta-v3-base", "modernbert-base", "t5-base", "whisper-small",
                           "clip-vit-base-patch32", "vit-base", "vit-large", "convnext-tiny", "swin-tiny",
                           "resnet-50"]
    for alias, name in [("FacebookAI/xlm-roberta-large", "xlm-roberta-large"), ("XLMR-Large", "xlm-roberta-large"),
                        ("gpt2-small", "gpt2"), ("meta-llama/Llama-2-7b-hf", "llama-7b"),
                        ("google/vit-base-patch16-224", "vit-base"), ("microsoft/resnet-50", "resnet-50"),
                        ("bert-base-uncased", "bert-base"), ("meta-llama/Llama-3.2-1B", "llama-1b")]:
        assert zoo.get(alias).name == name
    spec = zoo.get("xlm-roberta-large")
    assert spec.source == "FacebookAI/xlm-roberta-large" and isinstance(spec, ModelSpec)
    config = spec.config()
    assert (config.vocab_size, config.max_position_embeddings, config.type_vocab_size) == (250002, 514, 1)


def test_unknown_name_suggests_close_names():
    with pytest.raises(ValueError, match=r"'xlm-robrta-large'.*'xlm-roberta-large'.*names\(\)"):
        zoo.get("xlm-robrta-large")
    # canonical names, once each
    with pytest.raises(ValueError, match=r"Did you mean 'llama-7b', 'llama-1b', 'llama-3-8b'\?"):
        zoo.get("llama")


def test_unknown_task_lists_valid_ones():
    spec = zoo.get("bert-base")
    with pytest.raises(ValueError, match="causal-lm.*sequence-classification.*token-classification.*masked-lm"):
        spec.build("causal-lm", device="meta")
    with pytest.raises(ValueError, match="valid tasks"):
        spec.make_batch(spec.config(), task="image-classification")


def test_seq_len_beyond_positions():
    roberta = zoo.get("xlm-roberta-large")
    assert roberta.make_batch(roberta.config(), 1, seq_len=512)["input_ids"].shape == (1, 512)
    with pytest.raises(ValueError, match=r"at most 512 tokens.*padding_idx \+ 1.*max_position_embeddings"):
        roberta.make_batch(roberta.config(), 1, seq_len=513)
    gpt2 = zoo.get("gpt2")
    with pytest.raises(ValueError, match=r"at most 1024 tokens.*n_positions"):
        gpt2.make_batch(gpt2.config(), 1, seq_len=1025)
    t5 = zoo.get("t5-base")  # relative positions: no limit
    assert t5.make_batch(t5.config(), 1, seq_len=1000)["input_ids"].shape == (1, 1000)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        gpt2.make_batch(gpt2.config(), 1, seq_len=0)


def test_bad_override_names_the_field():
    with pytest.raises(ValueError, match="hiden_size.*hidden_size"):
        zoo.get("bert-base").config(hiden_size=32)


# --- config files -------------------------------------------------------------------------------
def _write_config(tmp_path, spec_name, architecture=None):
    spec = zoo.get(spec_name)
    config = spec.config(tiny=True)
    if architecture:
        config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    return spec, tmp_path / "config.json"


def test_config_file_round_trip_tiny_bert_masked_lm(tmp_path):
    zoo_spec, path = _write_config(tmp_path, "bert-base", "BertForMaskedLM")
    spec = zoo.from_config_file(path)
    assert (spec.family, spec.default_task, spec.tiny_overrides) == ("encoder", "masked-lm", {})
    assert set(spec.tasks) == set(zoo_spec.tasks)
    assert zoo.from_config_file(tmp_path).architectures == spec.architectures  # a directory works too
    model = spec.build()
    assert type(model) is transformers.BertForMaskedLM
    assert count_parameters(model) == count_parameters(zoo_spec.build("masked-lm", tiny=True))
    loss = model(**spec.make_batch(model, 3, seq_len=16, padded=True)).loss
    assert torch.isfinite(loss)
    loss.backward()
    with pytest.raises(ValueError, match="no tiny_overrides"):
        spec.build(tiny=True)


@pytest.mark.parametrize("name,arch,family,task", [
    ("llama-1b", "LlamaForCausalLM", "causal-lm", "causal-lm"),
    ("gpt2", "GPT2LMHeadModel", "causal-lm", "causal-lm"),
    ("t5-base", "T5ForConditionalGeneration", "seq2seq", "seq2seq-lm"),
    ("vit-base", "ViTForImageClassification", "vision", "image-classification"),
    ("resnet-50", "ResNetForImageClassification", "vision", "image-classification"),
])
def test_config_file_infers_family(tmp_path, name, arch, family, task):
    _, path = _write_config(tmp_path, name, arch)
    spec = zoo.from_config_file(path)
    assert (spec.family, spec.default_task) == (family, task)
    model = spec.build(device="meta")
    assert count_parameters(model) == count_parameters(zoo.get(name).build(tiny=True, device="meta"))


def test_config_file_task_picks_head_without_architectures(tmp_path):
    _, path = _write_config(tmp_path, "roberta-base")
    with pytest.raises(ValueError, match="no 'architectures' field.*task="):
        zoo.from_config_file(path)
    spec = zoo.from_config_file(path, task="token-classification")
    assert type(spec.build()) is transformers.RobertaForTokenClassification
    with pytest.raises(ValueError, match="valid tasks"):
        zoo.from_config_file(path, task="image-classification")


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="no config file at"):
        zoo.from_config_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no config file at .*config.json"):
        zoo.from_config_file(tmp_path)  # a directory without config.json
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        zoo.from_config_file(bad)
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model_type": "bertt", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match="unknown model_type 'bertt'.*'bert'"):
        zoo.from_config_file(unknown)
    untyped = tmp_path / "untyped.json"
    untyped.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="no 'model_type'"):
        zoo.from_config_file(untyped)
    pretraining = tmp_path / "pretraining.json"
    pretraining.write_text(json.dumps({"model_type": "bert", "architectures": ["BertForPreTraining"]}))
    with pytest.raises(ValueError, match="BertForPreTraining; pass task="):
        zoo.from_config_file(pretraining)
    assert zoo.from_config_file(pretraining, task="masked-lm").default_task == "masked-lm"
    ctc = tmp_path / "ctc.json"           # a family memfit makes no batch for: no empty list
    ctc.write_text(json.dumps({"model_type": "wav2vec2", "architectures": ["Wav2Vec2ForCTC"]}))
    with pytest.raises(ValueError, match="batches for no head of wav2vec2 models.*your own batch"):
        zoo.from_config_file(ctc)
    audio = tmp_path / "audio.json"       # raw audio in: no text batch made for it
    audio.write_text(json.dumps({"model_type": "hubert",
                                 "architectures": ["HubertForSequenceClassification"]}))
    with pytest.raises(ValueError, match="batches for no head of hubert models"):
        zoo.from_config_file(audio)


_POSITION_CONVENTIONS = {  # tiny models, 16 positions where the convention has a field for them
    "xlnet": transformers.XLNetConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2, d_inner=32),
    "t5": transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2),
    "gpt2": transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16),
    "roberta": transformers.RobertaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=32,
                                          max_position_embeddings=16),
    "gptj": transformers.GPTJConfig(vocab_size=64, n_embd=16, n_layer=1, n_head=2, rotary_dim=4,
                                    n_positions=16),
    "llama": transformers.LlamaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, intermediate_size=32,
                                      max_position_embeddings=16),
    "deberta-v2": transformers.DebertaV2Config(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32,
                                               max_position_embeddings=16, relative_attention=True,
                                               position_biased_input=False, pos_att_type=["p2c", "c2p"]),
}


@pytest.mark.parametrize("name", sorted(_POSITION_CONVENTIONS))
def test_table_limit_is_where_the_real_forward_fails(name):
    """Oracle: the model's own forward. At ``table_limit`` tokens it runs and one more fails; with
    no limit (XLNet's -1, relative and rotary positions) 3x the configured positions run, and
    zoo batches are made at that length where ``position_limit`` is None too."""
    from memfit.zoo._batches import make_batch, position_limit, table_limit

    config = _POSITION_CONVENTIONS[name]
    model = transformers.AutoModel.from_config(config).eval()
    limit, why = table_limit(config)

    def forward(length):
        ids = torch.randint(3, 60, (1, length))
        extra = {"decoder_input_ids": ids} if config.is_encoder_decoder else {}
        with torch.no_grad():
            model(input_ids=ids, **extra)

    if limit is None:
        forward(48)
    else:
        forward(limit)
        with pytest.raises((IndexError, RuntimeError)):
            forward(limit + 1)
    if position_limit(config)[0] is None:
        assert make_batch(config, "causal-lm", 1, seq_len=48)["input_ids"].shape == (1, 48), why
    assert (limit is None) == (name in ("xlnet", "t5", "llama", "deberta-v2")), why
