"""--freeze and --lora-rank (issue 11 item 9): fewer bytes than the full step, and exactly what
the API says for the same model frozen (or wrapped by PEFT) by hand."""

import json

import pytest

import memfit
from memfit import zoo
from memfit.cli import main

SHAPE = ["--seq-len", "32", "--batch-size", "2", "--gpu", "cpu"]


def cli_json(capsys, *args):
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _model_and_batch(config_dir):
    spec = zoo.from_config_file(config_dir)
    model = spec.build(device="meta")
    return spec, model, spec.make_batch(model, 2, seq_len=32)


def test_freeze_lowers_the_estimate_to_the_api_figure_for_that_model(capsys, tiny_gpt2):
    full = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE)
    frozen = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE,
                      "--freeze", "transformer.wte", "--freeze", "transformer.h.0.*")
    _, model, batch = _model_and_batch(tiny_gpt2)
    for name, p in model.named_parameters():        # the same parameters, named by hand
        if name.startswith(("transformer.wte.", "transformer.h.0.")):
            p.requires_grad_(False)
    api = memfit.estimate(model, batch, device="cpu")
    assert frozen["peak_bytes"] == api.peak_bytes < full["peak_bytes"]
    assert frozen["breakdown"] == api.breakdown
    assert frozen["trainable_parameters"] == sum(p.numel() for p in model.parameters()
                                                 if p.requires_grad)


def test_freeze_in_plan_matches_the_api_plan(capsys, tiny_gpt2):
    full = cli_json(capsys, "plan", "--config", tiny_gpt2, *SHAPE)
    frozen = cli_json(capsys, "plan", "--config", tiny_gpt2, *SHAPE, "--freeze", r".*\.h\.1\..*")
    _, model, batch = _model_and_batch(tiny_gpt2)
    for name, p in model.named_parameters():
        if ".h.1." in name:
            p.requires_grad_(False)
    api = memfit.plan(model, batch, device="cpu", precision="auto")
    assert frozen["plan"]["predicted_device_bytes"] == api.predicted_device_bytes
    assert frozen["plan"]["predicted_device_bytes"] < full["plan"]["predicted_device_bytes"]


def test_lora_rank_estimates_the_peft_model(capsys, tiny_gpt2):
    peft = pytest.importorskip("peft")
    full = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE)
    lora = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--lora-rank", "4")
    _, model, batch = _model_and_batch(tiny_gpt2)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type=peft.TaskType.CAUSAL_LM))
    api = memfit.estimate(wrapped, batch, device="cpu")
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert 0 < lora["trainable_parameters"] == trainable < full["trainable_parameters"]
    assert lora["peak_bytes"] == api.peak_bytes < full["peak_bytes"]
    assert lora["breakdown"]["optimizer"] < full["breakdown"]["optimizer"] / 10


def test_lora_without_peft_says_how_to_install_it(capsys, tiny_gpt2, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "peft", None)    # import peft -> ImportError
    assert main(["estimate", "--config", tiny_gpt2, *SHAPE, "--lora-rank", "4"]) == 2
    assert "pip install peft" in capsys.readouterr().err


@pytest.mark.parametrize("flags,needle", [
    (["--freeze", "no.such.layer"], "matches no parameter"),
    (["--freeze", "*"], "nothing is left to train"),
    (["--lora-rank", "0"], "at least 1"),
    (["--lora-rank", "4", "--lora-targets", "no_proj"], "for --lora-targets: c_attn, c_fc, c_proj"),
])
def test_bad_freeze_or_rank_is_one_line(capsys, tiny_gpt2, flags, needle):
    try:
        rc = main(["estimate", "--config", tiny_gpt2, *SHAPE, *flags])
    except SystemExit as e:      # argparse refuses the value itself
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_quantize_with_lora_estimates_the_qlora_model(capsys, tiny_gpt2):
    """--quantize nf4 --lora-rank 4 (issue 28 item 2): the API figure of the same model frozen,
    quantized by QuantizedBase and wrapped by PEFT, and less than LoRA on the float base."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from memfit.techniques import QuantizedBase
    lora = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--lora-rank", "4")
    qlora = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--lora-rank", "4",
                     "--quantize", "nf4")
    _, model, batch = _model_and_batch(tiny_gpt2)
    model.requires_grad_(False)
    QuantizedBase(QuantizedBase.Config("nf4")).apply(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type=peft.TaskType.CAUSAL_LM))
    api = memfit.estimate(wrapped, batch, device="cpu")
    assert qlora["peak_bytes"] == api.peak_bytes
    assert qlora["breakdown"]["params"] < lora["breakdown"]["params"]
    assert qlora["trainable_parameters"] == lora["trainable_parameters"]
    # the JSON says how the model was changed (the base is the model's own, no knob carries
    # it): a reader could not tell a QLoRA figure from a LoRA one
    assert (qlora["lora_rank"], qlora["quantize"], qlora["double_quant"]) == (4, "nf4", True)
    assert "quantize" not in lora and lora["lora_rank"] == 4


def test_quantize_kinds_are_the_techniques():
    from memfit.cli._common import QUANTIZE_KINDS
    from memfit.techniques.quantized_base import KINDS
    assert QUANTIZE_KINDS == KINDS + ("gptq",)       # techniques.packed_int4


@pytest.mark.parametrize("flags,needle", [
    (["--quantize", "nf4"], "add --lora-rank R (QLoRA) or --freeze"),
    (["--lora-targets", "c_attn"], "give --lora-rank R too"),
    (["--lora-rank", "4", "--lora-targets", ","], "give module names"),
])
def test_bad_quantize_or_targets_is_one_line(capsys, tiny_gpt2, flags, needle):
    assert main(["estimate", "--config", tiny_gpt2, *SHAPE, *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_what_if_rows_are_the_lora_model(capsys, tiny_gpt2):
    """--what-if rebuilds the model at each size: with --lora-rank each row is the LoRA model
    the plan is for (it was the full fine-tune), so the unscaled row is the LoRA estimate."""
    pytest.importorskip("peft")
    lora = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--lora-rank", "4")
    out = cli_json(capsys, "plan", "--config", tiny_gpt2, *SHAPE, "--lora-rank", "4",
                   "--what-if")
    rows = {(r["lever"], r["factor"]): r for r in out["what_if"]}
    assert rows[("seq_len", 1.0)]["peak_bytes"] == lora["peak_bytes"]
    assert rows[("seq_len", 0.25)]["peak_bytes"] < lora["peak_bytes"]


def test_lora_leaves_out_a_linear_subclass_with_a_forward_of_its_own():
    """PhiMoE's router subclasses nn.Linear and returns a tuple: under 'all-linear' PEFT wraps it
    and the wrapper fails on the tuple; memfit's default leaves it out, the linears stay in."""
    pytest.importorskip("peft")
    import torch
    from torch import nn

    from memfit.cli._adapt import apply_lora

    class Router(nn.Linear):
        def forward(self, x):
            logits = super().forward(x)
            return logits, logits.argmax(-1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.up, self.down = Router(8, 2), nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            _, chosen = self.router(x)
            return self.down(self.up(x)) * chosen.unsqueeze(-1)

    wrapped = apply_lora(Block(), 2, None)
    adapted = {n.split(".lora_A")[0] for n, _ in wrapped.named_parameters() if ".lora_A" in n}
    assert adapted == {"base_model.model.up", "base_model.model.down"}
    wrapped(torch.randn(3, 8)).sum().backward()        # the step runs


def test_a_quantized_base_counts_its_parameters_as_they_stand(capsys, tiny_gpt2):
    """'trains X of Y parameters': Y counted bitsandbytes' packed 4-bit bytes, so a QLoRA
    model had half the parameters of the same LoRA model."""
    pytest.importorskip("peft")
    lines = []
    for extra in ([], ["--quantize", "nf4"], ["--quantize", "int8"]):
        assert main(["estimate", "--config", tiny_gpt2, *SHAPE, "--lora-rank", "4",
                     *extra]) == 0
        out = " ".join(capsys.readouterr().out.split())
        lines.append(out[out.index("trains "):].split(" parameters")[0])
    assert len(set(lines)) == 1, lines


def test_lora_keeps_a_linear_subclass_that_returns_a_tensor():
    """Falcon builds every layer from FalconLinear(nn.Linear), a forward of its own that returns
    a tensor: those are LoRA's targets (a rule on the class alone left none)."""
    pytest.importorskip("peft")
    import torch
    import transformers as T

    from memfit.cli._adapt import apply_lora

    cfg = T.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4)
    with torch.device("meta"):
        model = T.FalconForCausalLM(cfg)
    wrapped = apply_lora(model, 2, "causal-lm")
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1]
               for n, _ in wrapped.named_parameters() if ".lora_A" in n}
    assert adapted == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_quantize_with_freeze_and_no_lora_is_estimated(capsys, tiny_gpt2, kind):
    """--quantize needs LoRA or --freeze for the layers it holds (cli._common.check_flags):
    with --freeze alone it is estimated, the frozen blocks in fewer bits."""
    full = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE,
                    "--freeze", "transformer.h")
    quantized = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--quantize", kind,
                         "--freeze", "transformer.h")
    assert quantized["breakdown"]["params"] < full["breakdown"]["params"]


def test_lora_on_gptq_layers_warns_of_nothing(capsys, tiny_gpt2):
    """PEFT warned 'Unsupported layer type PackedInt4Linear, proceed at your own risk' for the
    GPTQ layers memfit itself maps to PEFT's GPTQ LoRA layer: nothing for a user to act on."""
    pytest.importorskip("peft")
    assert main(["estimate", "--config", tiny_gpt2, *SHAPE, "--quantize", "gptq",
                 "--lora-rank", "4"]) == 0
    assert "Unsupported layer type" not in capsys.readouterr().err


def test_lora_on_a_model_whose_only_linear_layer_is_its_head_says_so():
    """'all-linear' on a convolutional classifier finds the head alone (PEFT's rule, so memfit
    counts it): a warning says LoRA adapts the head only and how to adapt the rest (Note 4); a
    transformer, whose blocks hold linear layers, gets none."""
    pytest.importorskip("peft")
    import warnings

    from memfit.cli._adapt import apply_lora

    resnet = zoo.get("resnet-50").build(tiny=True, device="meta")
    with pytest.warns(UserWarning, match=r"only linear layer of ResNetForImageClassification is "
                                         r"its head \(classifier\.1\).*--lora-targets"):
        wrapped = apply_lora(resnet, 4, "image-classification")
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all(".classifier.1." in n for n in trainable)
    gpt2 = zoo.get("gpt2").build(tiny=True, device="meta")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*only linear layer")
        apply_lora(gpt2, 4, "causal-lm")
