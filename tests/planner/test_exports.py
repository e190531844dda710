"""Plan exports: each target's keys and values, checked against what the target expects.

Where expected values come from:
- TrainingArguments: its dataclass fields in the installed transformers (constructing it needs
  accelerate, which is not a memfit dependency: that test runs only where accelerate is).
- Accelerate: the keys of ``ClusterConfig`` and of its ``deepspeed_config`` section, from
  accelerate's src/accelerate/commands/config/config_args.py and cluster.py (an unknown key in
  the file is an error there).
- DeepSpeed: https://www.deepspeed.ai/docs/config-json/ ("train_batch_size must be equal to
  train_micro_batch_size_per_gpu * gradient_accumulation_steps * number of GPUs"; fp16/bf16,
  gradient_clipping, zero_optimization.offload_optimizer, activation_checkpointing keys).
"""

import dataclasses
import json

import pytest
import yaml

from memfit import Knobs, Plan
from memfit.planner.exports import (Export, _training_arguments, export, to_accelerate_config,
                                    to_deepspeed_config, to_training_arguments)

PRECISIONS = ("fp32", "fp16", "bf16", "bf16-pure")
BLOCKS = [f"model.layers.{i}" for i in range(6)]

# accelerate's ClusterConfig (BaseConfig + ClusterConfig fields) and deepspeed_config plugin keys
ACCELERATE_KEYS = {
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
    "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
    "main_process_port", "rdzv_backend", "same_network", "main_training_function",
    "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config", "tp_config",
    "megatron_lm_config", "ipex_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
    "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config"}
ACCELERATE_DS_KEYS = {"zero_stage", "offload_optimizer_device", "offload_param_device",
                      "zero3_init_flag", "gradient_accumulation_steps", "gradient_clipping",
                      "offload_optimizer_nvme_path", "offload_param_nvme_path",
                      "zero3_save_16bit_model", "deepspeed_config_file"}
DS_TOP_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "gradient_clipping", "fp16", "bf16", "zero_optimization", "activation_checkpointing",
               "zero_force_ds_cpu_optimizer"}
DS_CKPT_KEYS = {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                "number_checkpoints", "synchronize_checkpoint_boundary", "profile"}


def plan(modes=(), **knobs) -> Plan:
    return Plan(Knobs(**knobs), blocks=dict(zip(BLOCKS, modes)))


def hf_fields():
    from transformers import TrainingArguments
    return {f.name: f for f in dataclasses.fields(TrainingArguments)}


# -- precision ------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_maps_to_each_target(precision):
    p = plan(precision=precision)
    hf = to_training_arguments(p, 8).config
    assert (hf["fp16"], hf["bf16"]) == {"fp32": (False, False), "fp16": (True, False),
                                        "bf16": (False, True), "bf16-pure": (False, True)}[precision]
    acc = to_accelerate_config(p, 8).config
    assert acc["mixed_precision"] == {"fp32": "no", "fp16": "fp16"}.get(precision, "bf16")
    ds = to_deepspeed_config(p, 8).config
    assert ("fp16" in ds, "bf16" in ds) == (hf["fp16"], hf["bf16"])
    if precision == "fp16":   # dynamic loss scale (loss_scale 0) from 2**16, as GradScaler
        assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                              "loss_scale_window": 2000, "hysteresis": 1, "min_loss_scale": 1}
    if hf["bf16"]:
        assert ds["bf16"] == {"enabled": True}


def test_bf16_pure_says_the_trainer_is_autocast():
    notes = to_training_arguments(plan(precision="bf16-pure"), 8).notes
    assert any("autocast" in n and "model.to(torch.bfloat16)" in n for n in notes)
    # DeepSpeed's bf16 *is* pure bf16 with fp32 masters: no precision note; autocast bf16 gets one
    assert not any(n.startswith("bf16") for n in to_deepspeed_config(plan(precision="bf16-pure"), 8).notes)
    assert any(n.startswith("bf16: DeepSpeed casts") for n in to_deepspeed_config(plan(precision="bf16"), 8).notes)


def test_unresolved_or_bad_input_is_refused():
    with pytest.raises(ValueError, match="'auto'"):
        to_deepspeed_config(plan(precision="auto"), 8)
    with pytest.raises(ValueError, match="batch_size"):
        to_training_arguments(plan(), 0)
    with pytest.raises(ValueError, match="world_size"):
        to_deepspeed_config(plan(), 8, world_size=0)
    with pytest.raises(ValueError, match="transformers, accelerate, deepspeed"):
        export(plan(), "lightning", 8)


# -- micro-batching -------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 4])
def test_uneven_micro_batches(world_size):
    # memfit: 32 = 6 x 5 + 2 (Accumulation.split); the targets can only run 7 x 5 = 35
    p = plan(micro_batch_size=5)
    hf = to_training_arguments(p, 32)
    assert (hf.config["per_device_train_batch_size"], hf.config["gradient_accumulation_steps"]) == (5, 7)
    ds = to_deepspeed_config(p, 32, world_size).config
    assert ds["train_micro_batch_size_per_gpu"] == 5 and ds["gradient_accumulation_steps"] == 7
    assert ds["train_batch_size"] == (ds["train_micro_batch_size_per_gpu"]
                                      * ds["gradient_accumulation_steps"] * world_size) == 35 * world_size
    for e in (hf, to_deepspeed_config(p, 32, world_size), to_accelerate_config(p, 32, world_size)):
        note = next(n for n in e.notes if n.startswith("micro-batches"))
        assert "6 x 5 + 2" in note and "35" in note and "micro_batch_size=4" in note


@pytest.mark.parametrize("micro, steps", [(8, 4), (None, 1), (64, 1)])
def test_even_micro_batches_have_no_note(micro, steps):
    p = plan(micro_batch_size=micro)
    ds = to_deepspeed_config(p, 32, world_size=2)
    assert ds.config["gradient_accumulation_steps"] == steps
    assert ds.config["train_batch_size"] == 64
    assert not any(n.startswith("micro-batches") for n in ds.notes)


# -- recompute and offload: transformers ------------------------------------------------------------

def test_no_recompute():
    e = to_training_arguments(plan(["keep"] * 6), 8)
    flag = "activation_checkpointing" if "activation_checkpointing" in hf_fields() else "gradient_checkpointing"
    assert e.config[flag] is False and flag + "_kwargs" not in e.config
    assert "activation_checkpointing" not in to_deepspeed_config(plan(["keep"] * 6), 8).config


NEW = frozenset({"activation_checkpointing", "activation_checkpointing_kwargs"})
OLD = frozenset({"gradient_checkpointing", "gradient_checkpointing_kwargs"})


def test_recompute_all_and_exact_every_n():
    e = _training_arguments(plan(["recompute"] * 6), 8, NEW)
    assert e.config["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    # layers 0, 3: what transformers' every_n_layers=3 recomputes (layer_index % n == 0)
    e = _training_arguments(plan(["recompute", "keep", "keep"] * 2), 8, NEW)
    assert e.config["activation_checkpointing_kwargs"] == {"use_reentrant": False, "every_n_layers": 3}
    assert not any("transformers recomputes" in n for n in e.notes)


def test_memfit_every_k_becomes_every_n_with_at_least_as_many_layers():
    # memfit every:3 recomputes blocks 2 and 5; transformers every_n_layers=3 takes 0 and 3
    e = _training_arguments(plan(["keep", "keep", "recompute"] * 2), 8, NEW)
    assert e.config["activation_checkpointing_kwargs"]["every_n_layers"] == 3
    assert any("2 of 6" in n and "model.layers.2, model.layers.5" in n for n in e.notes)
    # 4 of 6 cannot be every_n: every layer
    e = _training_arguments(plan(["recompute"] * 4 + ["keep"] * 2), 8, NEW)
    assert e.config["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    assert any("every layer (6 of 6)" in n for n in e.notes)


def test_selective_and_offload_become_full_recompute_with_offload():
    e = _training_arguments(plan(["selective", "keep", "offload", "keep", "recompute+offload", "keep"]),
                            8, NEW)
    kw = e.config["activation_checkpointing_kwargs"]
    assert kw["offload"] is True and kw["every_n_layers"] == 2   # blocks 0, 2, 4
    assert any(n.startswith("selective recompute (model.layers.0)") for n in e.notes)
    assert any(n.startswith("offload without recompute (model.layers.2)") for n in e.notes)
    assert any("also model.layers.0" in n for n in e.notes)


def test_old_transformers_is_all_or_nothing():
    e = _training_arguments(plan(["recompute+offload", "keep"] * 3), 8, OLD)
    assert e.config["gradient_checkpointing"] is True
    assert e.config["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert any("every layer or none" in n for n in e.notes)
    assert any("may exceed memfit's prediction" in n for n in e.notes)


def test_policy_without_blocks():
    e = _training_arguments(plan(checkpoint="every:2"), 8, NEW)
    assert e.config["activation_checkpointing_kwargs"]["every_n_layers"] == 2
    assert any("lists no blocks" in n for n in e.notes)
    e = _training_arguments(plan(checkpoint=("model.layers.1",), offload="all"), 8, NEW)
    assert e.config["activation_checkpointing_kwargs"] == {"use_reentrant": False, "offload": True}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_keywords_are_training_arguments_fields(precision):
    fields = hf_fields()
    p = plan(["recompute+offload", "keep"] * 3, precision=precision, micro_batch_size=5,
             max_grad_norm=1.0)
    kwargs = to_training_arguments(p, 32).config
    assert set(kwargs) <= set(fields)
    for key, value in kwargs.items():   # the type of each field's default (dicts default to None)
        default = fields[key].default
        assert default is None or type(value) is type(default), key
    assert kwargs["max_grad_norm"] == 1.0
    assert "max_grad_norm" not in to_training_arguments(plan(), 8).config   # the default stays


@pytest.mark.parametrize("precision", PRECISIONS)   # fp16 with use_cpu: accepted (5.24 + 1.15)
def test_training_arguments_accept_the_keywords(tmp_path, precision):
    pytest.importorskip("accelerate")   # TrainingArguments cannot be built without it
    from transformers import TrainingArguments

    kwargs = to_training_arguments(plan(["recompute"] * 6, precision=precision,
                                        micro_batch_size=4), 32).config
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **kwargs)
    assert args.gradient_accumulation_steps == 8 and args.per_device_train_batch_size == 4


def test_a_cpu_plan_exports_no_offload_and_train_runs_here():
    """transformers' offload pins host memory (save_on_cpu(pin_memory=True)): on this CPU-only
    machine a CPU plan's offload made trainer.train() stop in pin_memory (exports Note 5)."""
    pytest.importorskip("accelerate")
    import torch

    from tests.integrations.hf_helpers import tiny_trainer

    if torch.accelerator.is_available():
        pytest.skip("the fault is that of a machine without an accelerator")
    trainer = tiny_trainer("gpt2", max_steps=1)
    names = [n for n, _ in trainer.model.named_modules() if n.count(".") == 2 and ".h." in n]
    p = Plan(Knobs(), blocks={n: "recompute+offload" for n in names}, device="cpu")
    e = to_training_arguments(p, 2)
    assert e.config["activation_checkpointing"] is True
    assert "offload" not in e.config["activation_checkpointing_kwargs"]
    assert any("exported without offload" in n for n in e.notes)
    assert e.knobs.offload == "none" and e.knobs.checkpoint not in (None, "none")
    tiny_trainer("gpt2", max_steps=1, **e.config).train()          # runs where it was planned


def test_a_plan_without_a_device_keeps_offload_and_says_it_needs_a_gpu():
    e = _training_arguments(plan(["recompute+offload"] * 6), 8, NEW)
    assert e.config["activation_checkpointing_kwargs"]["offload"] is True
    assert any("needs a GPU" in n and "pin_memory" in n for n in e.notes)
    gpu = dataclasses.replace(plan(["recompute+offload"] * 6), device="a100-80gb")
    e = _training_arguments(gpu, 8, NEW)
    assert e.config["activation_checkpointing_kwargs"]["offload"] is True
    assert not any("pin_memory" in n for n in e.notes)


# -- Accelerate -----------------------------------------------------------------------------------

def test_accelerate_config_keys_and_yaml():
    e = to_accelerate_config(plan(["recompute"] * 6, micro_batch_size=8, max_grad_norm=0.5), 32)
    assert set(e.config) <= ACCELERATE_KEYS
    assert e.config["distributed_type"] == "NO" and e.config["num_processes"] == 1
    assert any("Accelerator(gradient_accumulation_steps=4)" in n for n in e.notes)
    assert any("clip_grad_norm_(model.parameters(), 0.5)" in n for n in e.notes)
    assert any("no activation checkpointing" in n for n in e.notes)
    text = e.to_yaml()
    assert yaml.safe_load(text) == e.config          # "NO" stays a string, notes are comments
    assert text.startswith("# ") and all(f"# {n}" in text for n in e.notes)
    assert to_accelerate_config(plan(), 8, world_size=2).config["distributed_type"] == "MULTI_GPU"


def test_accelerate_offload_optimizer_uses_deepspeed():
    e = to_accelerate_config(plan(offload_optimizer=True, micro_batch_size=8), 32, world_size=2)
    assert e.config["distributed_type"] == "DEEPSPEED"
    ds = e.config["deepspeed_config"]
    assert set(ds) <= ACCELERATE_DS_KEYS
    assert ds["zero_stage"] >= 1 and ds["offload_optimizer_device"] == "cpu"
    assert ds["gradient_accumulation_steps"] == 4 and "gradient_clipping" not in ds
    assert any("zero_force_ds_cpu_optimizer" in n for n in e.notes)


def test_accelerate_reads_the_file(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig

    path = tmp_path / "accelerate.yaml"
    path.write_text(to_accelerate_config(plan(offload_optimizer=True, precision="bf16"), 8).to_yaml())
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.deepspeed_config["offload_optimizer_device"] == "cpu"


# -- DeepSpeed ------------------------------------------------------------------------------------

def test_deepspeed_defaults():
    e = to_deepspeed_config(plan(), 16)
    assert set(e.config) <= DS_TOP_KEYS
    assert e.config["zero_optimization"] == {"stage": 0}
    assert "gradient_clipping" not in e.config        # DeepSpeed's default (1.0) stays
    assert json.loads(e.to_json()) == e.config


def test_deepspeed_offload_optimizer():
    e = to_deepspeed_config(plan(offload_optimizer=True, max_grad_norm=1.0), 16)
    zero = e.config["zero_optimization"]
    assert zero["stage"] in (1, 2, 3)                 # CPU offload: "Valid for ZeRO stage 1, 2, 3"
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert e.config["zero_force_ds_cpu_optimizer"] is False
    assert e.config["gradient_clipping"] == 1.0


@pytest.mark.parametrize("modes, cpu", [(["recompute", "keep"] * 3, False),
                                         (["recompute+offload", "keep"] * 3, True),
                                         (["offload", "keep"] * 3, True)])
def test_deepspeed_activation_checkpointing(modes, cpu):
    e = to_deepspeed_config(plan(modes), 16)
    section = e.config["activation_checkpointing"]
    assert set(section) <= DS_CKPT_KEYS
    assert section["cpu_checkpointing"] is cpu and section["partition_activations"] is False
    note = next(n for n in e.notes if "deepspeed.checkpointing.checkpoint" in n)
    assert "model.layers.0, model.layers.2, model.layers.4" in note


def test_plan_export_delegates():
    p = plan(["recompute"] * 6, precision="bf16", micro_batch_size=4)
    for target, direct in [("transformers", to_training_arguments(p, 16)),
                           ("accelerate", to_accelerate_config(p, 16)),
                           ("deepspeed", to_deepspeed_config(p, 16))]:
        assert p.export(target, 16) == direct
        assert isinstance(direct, Export)


def test_no_clipping_leaves_the_default_and_says_so():
    """A plan without max_grad_norm must not write 0.0, which would silently turn off the
    Trainer's default clipping (TrainingArguments.max_grad_norm = 1.0, read from the installed
    transformers) and DeepSpeed's (1.0 in its config reference)."""
    import transformers
    default = next(f.default for f in dataclasses.fields(transformers.TrainingArguments)
                   if f.name == "max_grad_norm")
    assert default == 1.0
    e = to_training_arguments(plan(), 8)
    assert "max_grad_norm" not in e.config
    assert any("clips the gradient norm at 1" in n for n in e.notes)
    assert e.knobs.max_grad_norm == 1.0                 # what the export runs
    d = to_deepspeed_config(plan(), 8)
    assert "gradient_clipping" not in d.config and d.knobs.max_grad_norm == 1.0
    e = to_training_arguments(plan(max_grad_norm=0.5), 8)
    assert e.config["max_grad_norm"] == 0.5 and e.knobs.max_grad_norm == 0.5
    assert not any("clips the gradient norm" in n for n in e.notes)


def test_exported_knobs_are_what_the_target_runs():
    """The Trainer keeps the optimizer on the device and recomputes layers 0, n, 2n, ..."""
    e = _training_arguments(plan(["keep", "keep", "recompute"] * 2, offload_optimizer=True,
                                 micro_batch_size=4), 8, NEW)
    assert e.knobs.offload_optimizer is False and e.knobs.micro_batch_size == 4
    assert e.knobs.checkpoint == (BLOCKS[0], BLOCKS[3])       # every_n_layers=3
    assert to_deepspeed_config(plan(offload_optimizer=True), 8).knobs.offload_optimizer is True


@pytest.mark.parametrize("target", ["transformers", "deepspeed", "accelerate"])
def test_gradients_moved_to_the_host_are_not_exported(target):
    """No target moves each gradient to the host as backward makes it: the export's knobs keep
    them on the device (with its optimizer state wherever the target keeps it), a note says
    so, and the knobs are a valid combination (re-traced by export_traced)."""
    p = plan(precision="bf16", micro_batch_size=8, offload_optimizer=True,
             offload_gradients=True)
    e = export(p, target, 32)
    assert not e.knobs.offload_gradients
    e.knobs.check_combinations(False)
    assert any(n.startswith("offload_gradients") for n in e.notes)
