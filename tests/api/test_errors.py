"""Bad input gets a clear error that names the problem and the fix."""

import pytest
import torch
from torch import nn

import memfit
from memfit import zoo
from tests.helpers import tiny


def test_unknown_model_suggests_close_names():
    with pytest.raises(ValueError, match="xlm-roberta-large"):
        zoo.get("xlm-roberta-larg")


def test_unknown_gpu_suggests_close_names():
    model, batch = tiny("bert-base")
    with pytest.raises(ValueError, match="gtx-1080-ti"):
        memfit.estimate(model, batch, device="gtx-1080")


def test_unparsable_budget():
    model, batch = tiny("bert-base")
    with pytest.raises(ValueError, match="11GiB"):
        memfit.estimate(model, batch, budget="lots")


def test_bf16_on_a_card_without_it():
    model, batch = tiny("bert-base")
    with pytest.raises(ValueError, match="fp16"):
        memfit.estimate(model, batch, device="gtx-1080-ti", precision="bf16")


def test_unknown_knob_names_the_valid_ones():
    model, batch = tiny("bert-base")
    with pytest.raises(TypeError, match="precision"):
        memfit.estimate(model, batch, precisoin="bf16")
    with pytest.raises(ValueError, match="bf16-pure"):
        memfit.estimate(model, batch, precision="int8")


def test_unknown_optimizer_suggests():
    model, batch = tiny("bert-base")
    with pytest.raises(ValueError, match="adamw"):
        memfit.estimate(model, batch, optimizer="adamww")


def test_sequence_longer_than_the_position_table():
    spec = zoo.get("xlm-roberta-large")
    model = spec.build(device="meta")
    batch = spec.make_batch(model, 2, seq_len=64)
    batch["input_ids"] = torch.randint(5, 100, (2, 600))
    with pytest.raises(ValueError, match="at most 512 tokens") as caught:
        memfit.estimate(model, batch)
    assert "--" not in str(caught.value)   # an API error names the API's arguments, not CLI flags


def test_no_position_limit_is_not_a_limit_of_minus_one():
    """XLNet's max_position_embeddings is -1, "no sequence length limit": its batch is estimated
    (it was refused as longer than -1 positions)."""
    import transformers

    config = transformers.XLNetConfig(vocab_size=128, d_model=32, n_layer=2, n_head=2, d_inner=64)
    model = transformers.XLNetLMHeadModel(config)
    ids = torch.randint(3, 120, (2, 16))
    assert memfit.estimate(model, {"input_ids": ids, "labels": ids.clone()}).peak_bytes > 0


def test_token_ids_outside_the_vocabulary():
    model, batch = tiny("bert-base")
    batch["input_ids"][0, 0] = model.config.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        memfit.estimate(model, batch)


def test_batch_keys_the_model_does_not_take():
    model, batch = tiny("resnet-50")
    batch["input_ids"] = torch.zeros(3, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="input_ids"):
        memfit.estimate(model, batch)


def test_batch_of_the_wrong_shape():
    model, batch = tiny("vit-base")
    batch["pixel_values"] = torch.randn(3, 1, 32, 32)
    with pytest.raises(ValueError, match="channel"):
        memfit.estimate(model, batch)


def test_non_mapping_batch_without_loss_fn():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="loss_fn"):
        memfit.estimate(model, torch.randn(3, 4))


def test_batch_without_labels():
    model, batch = tiny("bert-base")
    del batch["labels"]
    with pytest.raises(ValueError, match="labels"):
        memfit.estimate(model, batch)


class _Head(nn.Module):
    def forward(self, h):
        if h.sum() > 0:          # a Python branch on tensor data
            return h.mean()
        return -h.mean()


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = _Head()

    def forward(self, x):
        return {"loss": self.head(self.lin(x))}


def test_an_op_the_fake_trace_cannot_run_names_op_and_module():
    with pytest.raises(memfit.TraceError) as info:
        memfit.estimate(_Branchy(), {"x": torch.randn(2, 4)})
    assert info.value.op == "aten._local_scalar_dense.default"
    assert info.value.module == "head"
    assert "head" in str(info.value) and "memfit.track" in str(info.value)


def test_precision_auto_is_not_for_estimate():
    model, batch = tiny("bert-base")
    with pytest.raises(ValueError, match="fixed precision"):
        memfit.estimate(model, batch, precision="auto")


def test_a_name_where_a_module_is_needed():
    """Every front that takes a model says how to get one from a name (was AttributeError:
    'str' object has no attribute 'parameters'); something else is named by its type."""
    model, batch = tiny("gpt2")
    zoo_call = r"memfit\.zoo\.get\('gpt2'\); model = spec\.build\(device='meta'\)"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fronts = {"estimate": lambda m: memfit.estimate(m, batch),
              "plan": lambda m: memfit.plan(m, batch, budget="1GiB"),
              "fit": lambda m: memfit.fit(m, opt, batch),
              "estimate_sharded": lambda m: memfit.estimate_sharded(m, batch, world_size=2),
              "estimate gpus": lambda m: memfit.estimate(m, batch, gpus=2, sharding="fsdp"),
              "track": lambda m: memfit.track(m)}
    for name, call in fronts.items():
        with pytest.raises(ValueError, match=zoo_call):
            call("gpt2")
        with pytest.raises(ValueError, match="must be a torch.nn.Module .*got NoneType" if
                           name != "track" else "got dict"):
            call(None if name != "track" else {"model": model})
    with pytest.raises(ValueError, match="zoo.names()"):
        memfit.estimate("no-such-model", batch)
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer.*'adamw'"):
        memfit.track(model, "adamw")


def test_integrations_name_the_object_they_need():
    """The integrations' entry points given the wrong object (a model for the Trainer, the
    model where the Accelerator goes) say what they need (was AttributeError: no 'args')."""
    model, batch = tiny("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mf_hf = pytest.importorskip("memfit.integrations.transformers")
    with pytest.raises(ValueError, match="give a transformers.Trainer.*got GPT2LMHeadModel"):
        mf_hf.estimate(model)
    with pytest.raises(ValueError, match="give a transformers.Trainer.*got str"):
        mf_hf.fit("trainer", budget="1GiB")
    mf_acc = pytest.importorskip("memfit.integrations.accelerate")
    with pytest.raises(ValueError, match="give the accelerate.Accelerator.*got GPT2LMHeadModel"):
        mf_acc.estimate(model, opt, batch, None)
