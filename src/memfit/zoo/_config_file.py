"""``from_config_file``: a ``ModelSpec`` for any Hugging Face ``config.json``.

Note 1 (which class per task). The class named first in ``architectures`` serves the task its
name implies (``BertForMaskedLM`` -> masked-lm). The family's other tasks get the class that
transformers' Auto class for that task maps this ``model_type`` to (the ``*_MAPPING_NAMES``
tables), so a config saved from a masked-LM checkpoint can still be built for classification.

Note 2 (family). ``is_encoder_decoder`` -> seq2seq; a config with image fields (``num_channels``,
``image_size``) -> vision; a ``*ForCausalLM``/``*LMHead*`` class or task causal-lm -> causal-lm;
a config with ``text_config`` and ``vision_config`` (CLIP) -> multimodal; anything else -> encoder.

Note 3 (bare models). A config saved from the bare model (``BartModel``, ``BertModel``: the class
transformers' ``AutoModel`` maps the ``model_type`` to) names no head; it trains with the
family's first head that exists for the ``model_type`` (``BartModel`` -> seq2seq-lm with
``BartForConditionalGeneration``, ``CLIPModel`` -> contrastive), unless ``task`` says otherwise.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import transformers
from transformers import AutoConfig
from transformers.models.auto import configuration_auto, modeling_auto

from memfit._zoo_names import config_file
from memfit.zoo._config_errors import CONFIG_ERRORS, check_sizes, invalid_config
from memfit.zoo._spec import ModelSpec

__all__ = ["from_config_file"]

_FAMILY_TASKS = {"encoder": ("sequence-classification", "token-classification", "masked-lm"),
                 "causal-lm": ("causal-lm",), "seq2seq": ("seq2seq-lm", "speech-seq2seq"),
                 "vision": ("image-classification",), "multimodal": ("contrastive",)}
_AUTO_NAMES = {"sequence-classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
               "token-classification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
               "masked-lm": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
               "causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
               "seq2seq-lm": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
               "image-classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
               "speech-seq2seq": modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
               "contrastive": modeling_auto.MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES}
_CLASS_SUFFIX_TASKS = (("ForSequenceClassification", "sequence-classification"),
                       ("ForTokenClassification", "token-classification"), ("ForMaskedLM", "masked-lm"),
                       ("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"),
                       ("ForConditionalGeneration", "seq2seq-lm"), ("ForImageClassification", "image-classification"))
_NOT_CONFIG_FIELDS = ("architectures", "model_type", "transformers_version", "_name_or_path")


def from_config_file(path: str | Path, task: str | None = None) -> ModelSpec:
    """A spec built from a Hugging Face ``config.json`` (the file, or a directory holding it).

    The head class comes from the file's ``architectures`` (Note 1), or, when it has none, from
    ``task`` through the family's Auto class. The spec has no ``tiny_overrides``.
    """
    file, fields = _read_json(Path(path))
    model_type = fields.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{file} has no 'model_type' field: is it a Hugging Face model config.json?")
    values = {k: v for k, v in fields.items() if k not in _NOT_CONFIG_FIELDS}
    config = _make_config(file, model_type, values)

    arch = (fields.get("architectures") or [None])[0]
    if arch is None and task is None:
        raise ValueError(f"{file} has no 'architectures' field, so the model class is unknown: pass "
                         f"task=NAME to pick the head, NAME one of {sorted(_AUTO_NAMES)}")
    family = _infer_family(config, arch, task)
    architectures = {t: _auto_class(_AUTO_NAMES[t], model_type) for t in _FAMILY_TASKS[family]}
    arch_task = _check_architecture(file, arch, family, model_type) if arch is not None else None
    if arch_task is not None:
        architectures[arch_task] = arch
    architectures = {t: c for t, c in architectures.items() if c is not None}
    default_task = task or arch_task or _base_model_task(arch, model_type, architectures)
    if (default_task is None and not architectures) or _main_input(arch, model_type) not in \
            _BATCHED_INPUTS:      # raw audio (input_values) among them
        raise ValueError(f"{file}: memfit makes batches for no head of {model_type} models (the "
                         f"file names {arch}): build the model yourself and estimate it with "
                         "your own batch, memfit.estimate(memfit.Job(model, batch))")
    if default_task is None:
        raise ValueError(f"{file}: memfit makes no batches for the head {arch}; pass task=NAME to "
                         f"build the {model_type} model with that head instead, NAME one of "
                         f"{sorted(architectures)}")
    if default_task not in architectures:
        raise ValueError(f"task {default_task!r} is not available for this {family} {model_type} model "
                         f"({file}): valid tasks are {sorted(architectures)}")
    name = fields.get("_name_or_path") or file.parent.name or model_type
    return ModelSpec(name=name, family=family, config_class=type(config), config_values=values,
                     architectures=architectures, default_task=default_task, source=str(file))


def _read_json(path: Path) -> tuple[Path, dict]:
    file = config_file(path)
    try:
        fields = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file} is not valid JSON ({err}): fix the file or re-save it with "
                         "config.save_pretrained(dir)") from err
    if not isinstance(fields, dict):
        raise ValueError(f"{file} holds a JSON {type(fields).__name__}, not the object a config.json holds")
    return file, fields


def _make_config(file: Path, model_type: str, values: dict) -> transformers.PretrainedConfig:
    if model_type not in configuration_auto.CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(configuration_auto.CONFIG_MAPPING_NAMES), n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"unknown model_type {model_type!r} in {file}: transformers {transformers.__version__} "
                         f"has no config class for it.{hint} Fix the field, or upgrade transformers.")
    check_sizes(str(file), values)
    try:
        config = AutoConfig.for_model(model_type, **values)
    except CONFIG_ERRORS as err:
        fields = set(values) | set(vars(configuration_auto.CONFIG_MAPPING[model_type]()))
        raise invalid_config(str(file), sorted(fields), err) from err
    check_sizes(str(file), config)
    return config


def _infer_family(config: transformers.PretrainedConfig, arch: str | None, task: str | None) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if getattr(config, "text_config", None) is not None and getattr(config, "vision_config", None) is not None:
        return "multimodal"
    if hasattr(config, "num_channels") or hasattr(config, "image_size"):
        return "vision"
    if (arch and (arch.endswith("ForCausalLM") or "LMHead" in arch)) or task == "causal-lm":
        return "causal-lm"
    return "encoder"


def _check_architecture(file: Path, arch: str, family: str, model_type: str) -> str | None:
    """The task that the class ``arch`` serves, or ``None`` if memfit makes no batch for it."""
    if not hasattr(transformers, arch):
        raise ValueError(f"architecture {arch!r} in {file} is not a class of transformers "
                         f"{transformers.__version__}: fix the 'architectures' field or upgrade transformers")
    listed = next((t for t in _FAMILY_TASKS[family] if _auto_class(_AUTO_NAMES[t], model_type) == arch), None)
    task = listed or next((t for suffix, t in _CLASS_SUFFIX_TASKS if arch.endswith(suffix)), None)
    return task if task in _FAMILY_TASKS[family] else None


def _base_model_task(arch: str | None, model_type: str, architectures: dict[str, str]) -> str | None:
    """Note 3: a bare ``{Prefix}Model`` class trains with its family's first head."""
    bare = arch is not None and _auto_class(modeling_auto.MODEL_MAPPING_NAMES, model_type) == arch
    return next(iter(architectures), None) if bare else None


_BATCHED_INPUTS = ("input_ids", "pixel_values", "input_features", None)  # zoo._batches makes


def _main_input(arch: str | None, model_type: str) -> str | None:
    """The ``main_input_name`` of the file's class (else the family's bare model), or None."""
    name = arch or _auto_class(modeling_auto.MODEL_MAPPING_NAMES, model_type)
    return getattr(getattr(transformers, name, None), "main_input_name", None) if name else None


def _auto_class(table: dict, model_type: str) -> str | None:
    name = table.get(model_type)
    return name[0] if isinstance(name, (list, tuple)) else name
