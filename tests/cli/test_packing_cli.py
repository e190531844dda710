"""--packing and --attn-implementation (issue 28 item 5): the tokens per batch, the JSON, the
figures the API gives for the same packed batch, and bad input in one line before any trace."""

import importlib
import json

import pytest

import memfit
from memfit import zoo
from memfit.cli import main
from memfit.cli._common import ATTENTION_NAMES

SHAPE = ["--batch-size", "2", "--seq-len", "16"]


def cli_json(capsys, *args):
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_attention_names_are_the_zoo_s():
    from memfit.zoo._spec import ATTENTION

    assert ATTENTION_NAMES == ATTENTION


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_help_says_what_the_flags_do(capsys, command):
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--packing" in out and "DataCollatorWithFlattening" in out
    assert "tokens per batch" in out and "flash_attention_2" in out


def test_estimate_packs_batch_size_sequences_as_the_api_does(capsys, tiny_gpt2):
    out = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--packing", "--gpu", "cpu")
    assert out["packing"] == {"sequences": 2, "sequence_tokens": 16, "tokens_per_batch": 32,
                              "attn_implementation": "sdpa"}
    assert out["batch"] == {"input_ids": [1, 32], "labels": [1, 32], "position_ids": [1, 32]}
    spec = zoo.from_config_file(tiny_gpt2)
    model = spec.build(device="meta")
    model.config.use_cache = False            # what --packing sets, as the Trainer does
    api = memfit.estimate(model, spec.make_batch(model, 2, seq_len=16, packing=True),
                          device="cpu")
    assert out["peak_bytes"] == api.peak_bytes and out["breakdown"] == api.breakdown


def test_plan_json_carries_the_packing(capsys, tiny_gpt2):
    out = cli_json(capsys, "plan", "--config", tiny_gpt2, *SHAPE, "--packing", "--gpu", "cpu")
    assert out["packing"]["tokens_per_batch"] == 32 and out["batch"]["input_ids"] == [1, 32]


def test_flash_attention_on_a_gpu_runs_the_varlen_kernel(capsys, tiny_gpt2):
    out = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--packing",
                   "--attn-implementation", "flash_attention_2", "--precision", "bf16",
                   "--gpu", "rtx-4090")
    assert out["packing"]["attn_implementation"] == "flash_attention_2"
    assert any("2x varlen (2 sequences in 32 tokens)" in n for n in out["notes"])


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "--model", "llama-1b", "--packing", "--padded"], "not both"),
    (["estimate", "--packing"], "causal LMs"),                    # xlm-roberta-large by default
    (["plan", "--model", "llama-1b", "--packing", "--seq-len", "auto"], "--seq-len auto"),
    (["plan", "--model", "llama-1b", "--packing", "--batch-size", "auto"], "--batch-size auto"),
    (["plan", "--model", "llama-1b", "--attn-implementation", "flash_attention_2"],
     "--precision bf16"),
    (["estimate", "--model", "llama-1b", "--attn-implementation", "flash_attention_2",
      "--precision", "bf16", "--gpu", "cpu"], "no CPU kernel"),
    (["estimate", "--model", "gemma-2-2b", "--attn-implementation", "sdpa"], "has no sdpa"),
])
def test_bad_input_is_one_line_before_any_trace(capsys, monkeypatch, argv, needle):
    module = importlib.import_module("memfit.api._traced")

    def traced(*args, **kwargs):
        raise AssertionError("a step was traced before the input was checked")

    monkeypatch.setattr(module, "profile_step", traced)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("memfit: error:") and len(err.splitlines()) == 1


def test_a_model_that_reads_no_positions_is_refused(capsys, tmp_path):
    from transformers import BloomConfig

    config = BloomConfig(vocab_size=128, hidden_size=32, n_layer=1, n_head=2)
    config.architectures = ["BloomForCausalLM"]
    config.save_pretrained(tmp_path)
    assert main(["estimate", "--config", str(tmp_path), "--packing", "--gpu", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "takes no position_ids" in err and len(err.splitlines()) == 1


def test_flash_attention_on_an_older_gpu_is_one_line(capsys, tiny_gpt2):
    assert main(["estimate", "--config", tiny_gpt2, *SHAPE, "--packing", "--attn-implementation",
                 "flash_attention_2", "--precision", "fp16", "--gpu", "gtx-1080-ti"]) == 2
    err = capsys.readouterr().err
    assert "sm80+" in err and "sm61" in err and len(err.splitlines()) == 1


def test_packing_with_lora_is_the_api_s_peft_model(capsys, tiny_gpt2):
    """peft's forward names some inputs and passes the rest (position_ids) to the base model:
    the batch check looks through it (a packed batch with --lora-rank was refused)."""
    peft = pytest.importorskip("peft")
    out = cli_json(capsys, "estimate", "--config", tiny_gpt2, *SHAPE, "--packing", "--gpu",
                   "cpu", "--lora-rank", "4")
    spec = zoo.from_config_file(tiny_gpt2)
    model = spec.build(device="meta")
    model.config.use_cache = False
    wrapped = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type=peft.TaskType.CAUSAL_LM))
    api = memfit.estimate(wrapped, spec.make_batch(model, 2, seq_len=16, packing=True),
                          device="cpu")
    assert out["peak_bytes"] == api.peak_bytes


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_a_batch_with_a_flag_prints_its_tensors_shapes(capsys, tmp_path, command):
    """A contrastive batch holds return_loss=True beside its tensors: the shapes are the
    tensors' (the CLI raised AttributeError on the bool)."""
    zoo.get("clip-vit-base-patch32").build(tiny=True, device="meta").config.save_pretrained(
        tmp_path)
    out = cli_json(capsys, command, "--config", str(tmp_path / "config.json"), "--task",
                   "contrastive", "--batch-size", "2", "--gpu", "cpu")
    assert set(out["batch"]) == {"input_ids", "attention_mask", "pixel_values"}
