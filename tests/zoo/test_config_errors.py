"""Bad config files give one ValueError naming the file, the field and the fix (issue 11 item 10)."""

import json

import pytest

from memfit import zoo


def write(tmp_path, fields, name="config.json"):
    path = tmp_path / name
    path.write_text(fields if isinstance(fields, str) else json.dumps(fields))
    return path


@pytest.mark.parametrize("model_type,arch", [("llama", "LlamaForCausalLM"), ("bert", "BertForMaskedLM")])
def test_hidden_size_not_divisible_by_heads(tmp_path, model_type, arch):
    path = write(tmp_path, {"model_type": model_type, "architectures": [arch], "hidden_size": 65,
                            "num_attention_heads": 4, "vocab_size": 100})
    with pytest.raises(ValueError) as err:
        zoo.from_config_file(path).build(device="meta")
    assert type(err.value) is ValueError
    message = str(err.value)
    assert str(path) in message and "'hidden_size'" in message and "'num_attention_heads'" in message
    assert "Fix the fields" in message


def test_a_field_of_the_wrong_type(tmp_path):
    path = write(tmp_path, {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": "big"})
    with pytest.raises(ValueError, match=r"config\.json: the config is invalid \(field 'hidden_size'\).*expected int"):
        zoo.from_config_file(path)


def test_a_bad_override_of_a_zoo_model():
    with pytest.raises(ValueError, match=r"meta-llama/Llama-3\.2-1B.*'hidden_size'"):
        zoo.get("llama-1b").config(hidden_size="wide")


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no config file at .*nothing.json: pass the path"):
        zoo.from_config_file(tmp_path / "nothing.json")


def test_malformed_json(tmp_path):
    path = write(tmp_path, '{"model_type": "bert",')
    with pytest.raises(ValueError, match="config.json is not valid JSON .*fix the file"):
        zoo.from_config_file(path)


def test_unknown_model_type(tmp_path):
    path = write(tmp_path, {"model_type": "lama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="unknown model_type 'lama' in .*config.json.*Did you mean 'llama'"):
        zoo.from_config_file(path)


def test_unknown_task(tmp_path):
    path = write(tmp_path, {"model_type": "bert", "architectures": ["BertForMaskedLM"]})
    with pytest.raises(ValueError, match="task 'summarise' is not available .*config.json.*valid tasks are"):
        zoo.from_config_file(path, task="summarise")
    with pytest.raises(ValueError, match="unknown task 'summarise' .*valid tasks are"):
        zoo.from_config_file(path).check_task("summarise")


@pytest.mark.parametrize("model_type,arch,field,value", [
    ("gpt2", "GPT2LMHeadModel", "n_layer", -2),               # was "__len__() should return >= 0"
    ("bert", "BertForMaskedLM", "num_hidden_layers", -2),     # was an empty ModuleList: 0 layers
    ("llama", "LlamaForCausalLM", "hidden_size", -8),         # was torch's "negative dimension"
    ("bert", "BertForMaskedLM", "num_attention_heads", 0),
])
def test_a_size_that_is_not_positive(tmp_path, model_type, arch, field, value):
    """A config.json, and the same field as a zoo override, name the field and its value before
    anything is built."""
    path = write(tmp_path, {"model_type": model_type, "architectures": [arch], field: value})
    expected = rf"the config is invalid \(field '{field}'\): {field} must be a positive int, got {value}"
    with pytest.raises(ValueError, match=expected):
        zoo.from_config_file(path).build(device="meta")
    name = {"gpt2": "gpt2", "bert": "bert-base", "llama": "llama-1b"}[model_type]
    with pytest.raises(ValueError, match=expected):
        zoo.get(name).build(tiny=True, **{field: value})


def test_sizes_in_a_sub_config_and_per_stage_lists():
    """CLIP's text_config is checked as its own config; Swin's per-stage head counts entry by
    entry (a valid list passes)."""
    with pytest.raises(ValueError, match=r"\(text_config\).*'num_hidden_layers'.*got -1"):
        zoo.get("clip-vit-base-patch32").config(text_config={"num_hidden_layers": -1})
    swin = zoo.get("swin-tiny")
    assert swin.config().num_heads == [3, 6, 12, 24]
    with pytest.raises(ValueError, match=r"'num_heads'.*positive int per entry"):
        swin.config(num_heads=[3, 6, -12, 24])


def test_a_field_the_models_step_reads_and_the_config_lacks(tmp_path):
    """T5Config(...) saved by transformers 5 has no decoder_start_token_id, which T5's forward
    reads: refused as bad input naming the field and where to set it (trace.profile Note 5),
    not an AttributeError from inside the model."""
    import memfit
    from transformers import T5Config

    T5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=2, d_kv=16,
             vocab_size=100).save_pretrained(tmp_path)
    if "decoder_start_token_id" in json.loads((tmp_path / "config.json").read_text()):
        pytest.skip("this transformers still writes decoder_start_token_id")
    spec = zoo.from_config_file(tmp_path / "config.json", task="seq2seq-lm")
    model = spec.build(tiny=False)
    batch = spec.make_batch(model, 2, seq_len=8)
    with pytest.raises(ValueError, match=r"T5Config has no 'decoder_start_token_id', which "
                                         r"T5ForConditionalGeneration's step reads .*"
                                         r"modeling_t5\.py.*add \"decoder_start_token_id\""):
        memfit.estimate(memfit.Job(model, batch, optimizer="adamw"), device="cpu")


def test_a_sequence_classifier_without_a_pad_token_is_told_where_to_set_it(tmp_path):
    """transformers refuses a batch of two rows when pad_token_id is unset, in its words; memfit
    adds the field and the file (trace.profile Note 5)."""
    import memfit
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=100)
    config.pad_token_id = None
    config.save_pretrained(tmp_path)
    spec = zoo.from_config_file(tmp_path / "config.json", task="sequence-classification")
    model = spec.build()
    batch = spec.make_batch(model, 2, seq_len=8)
    with pytest.raises(ValueError, match=r"no padding token is defined.*Qwen2ForSequence"
                                         r"Classification.*add \"pad_token_id\""):
        memfit.estimate(memfit.Job(model, batch, optimizer="adamw"), device="cpu")
