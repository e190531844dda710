"""``ModelSpec``: one model of the zoo: its real config, the head class per task, a tiny twin.

Note 1 (how models are built). ``build`` instantiates the head class from a config with
``_from_config`` (random weights; nothing is downloaded). On the ``meta`` device it runs under
``with torch.device("meta")`` so a 7B model costs no memory; otherwise it seeds torch inside
``torch.random.fork_rng`` (the caller's RNG state is left as it was) and builds directly on the
device, so the same ``seed`` gives the same weights. ``dtype=None`` means torch's default
(float32), whatever ``torch_dtype`` a config file carries: memfit changes precision only when
asked. Attention is ``"sdpa"`` wherever the class supports it, and the model is in train mode.
``attn_implementation="flash_attention_2"`` builds the same model and then names flash-attn 2 in
its config, which transformers reads at each forward: transformers refuses to build it where
flash-attn is not installed (a CPU machine), and memfit models its kernels for a GPU target
(``memfit.trace.cuda_flash_attn``).

Note 2 (tiny twins). ``tiny_overrides`` shrink widths, depths, vocabulary and positions but keep
the architecture class and every structural switch (tied embeddings, RoPE type, GQA, pre/post
norm), so a tiny model exercises the same code paths as the full one in a fraction of a second.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

from memfit._zoo_names import check_task
from memfit.zoo import _batches
from memfit.zoo._config_errors import CONFIG_ERRORS, check_sizes, invalid_config
from memfit.zoo._packing import check_packable, packed_batch

__all__ = ["ModelSpec", "count_parameters", "FAMILIES", "TASKS", "ATTENTION"]

FAMILIES = ("encoder", "causal-lm", "seq2seq", "vision", "multimodal")
TASKS = _batches.TASKS


@dataclass(frozen=True)
class ModelSpec:
    """A model memfit knows how to build and feed: real config plus one head class per task."""

    name: str
    """Canonical name, e.g. ``"xlm-roberta-large"``."""
    family: str
    """One of ``FAMILIES``: ``"encoder" | "causal-lm" | "seq2seq" | "vision" | "multimodal"``."""
    config_class: type[transformers.PretrainedConfig]
    """The transformers config class, e.g. ``XLMRobertaConfig``."""
    config_values: Mapping[str, Any] = field(hash=False)
    """Keyword arguments of ``config_class`` copied from the real ``config.json`` (see ``source``)."""
    architectures: Mapping[str, str] = field(hash=False)
    """Task name -> transformers class name, e.g. ``{"causal-lm": "GPT2LMHeadModel"}``."""
    default_task: str
    """The task ``build``/``make_batch`` use when none is given."""
    tiny_overrides: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Config overrides for a tiny model of the same class, for tests (Note 2); may be empty."""
    aliases: tuple[str, ...] = ()
    """Other names ``memfit.zoo.get`` accepts (hub ids, common short names)."""
    source: str = ""
    """Where ``config_values`` come from: a hub repo id whose config.json they copy, or a path."""

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelSpec {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        unknown = [t for t in self.architectures if t not in TASKS]
        if unknown or not self.architectures:
            raise ValueError(f"ModelSpec {self.name!r}: tasks must be a non-empty subset of {TASKS}, got {unknown}")
        if self.default_task not in self.architectures:
            raise ValueError(f"ModelSpec {self.name!r}: default_task {self.default_task!r} is not one of {self.tasks}")

    @property
    def tasks(self) -> tuple[str, ...]:
        """The task names valid for this model, in declaration order."""
        return tuple(self.architectures)

    def check_task(self, task: str | None) -> str:
        """Return ``task`` (or the default task when ``None``); raise ``ValueError`` if invalid."""
        if task is None:
            return self.default_task
        check_task(self.name, self.tasks, task)
        return task

    def model_class(self, task: str | None = None) -> type[nn.Module]:
        """The transformers class that implements ``task`` for this model."""
        return getattr(transformers, self.architectures[self.check_task(task)])

    def config(self, tiny: bool = False, **overrides: Any) -> transformers.PretrainedConfig:
        """The model's config; ``tiny=True`` applies ``tiny_overrides`` first, then ``overrides``."""
        values = copy.deepcopy(dict(self.config_values))
        if tiny:
            if not self.tiny_overrides:
                raise ValueError(
                    f"{self.name} has no tiny_overrides, so tiny=True would build the full-size "
                    "model: pass the small sizes as keyword overrides instead (e.g. num_hidden_layers=2)"
                )
            values.update(copy.deepcopy(dict(self.tiny_overrides)))
        self._check_override_names(overrides)
        values.update(overrides)
        check_sizes(self.source or self.name, values)
        try:
            config = self.config_class(**values)
        except CONFIG_ERRORS as err:
            raise invalid_config(self.source or self.name, sorted(values), err) from err
        check_sizes(self.source or self.name, config)
        return config

    def build(self, task: str | None = None, *, tiny: bool = False, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None, seed: int = 0, attn_implementation: str | None = None,
              **overrides: Any) -> nn.Module:
        """Build the model for ``task`` with random weights, in train mode (Note 1).

        ``device="meta"`` allocates nothing; any other device gets real weights seeded by ``seed``.
        ``attn_implementation``: "sdpa" (the default where the class has it), "eager" or
        "flash_attention_2" (Note 1). ``overrides`` are config fields (e.g. ``num_hidden_layers=2``).
        """
        cls = self.model_class(task)
        attn = _check_attention(cls, attn_implementation)
        config = self.config(tiny=tiny, **overrides)
        kwargs: dict[str, Any] = {"dtype": dtype or torch.get_default_dtype()}
        if getattr(cls, "_supports_sdpa", False) or attn == "eager":
            kwargs["attn_implementation"] = "eager" if attn == "eager" else "sdpa"
        device = torch.device(device)
        try:
            if device.type == "meta":
                with torch.device("meta"):
                    model = cls._from_config(config, **kwargs)
            else:
                rng_devices = [device.index or 0] if device.type == "cuda" else []
                with torch.random.fork_rng(devices=rng_devices):
                    torch.manual_seed(seed)
                    with device:
                        model = cls._from_config(config, **kwargs)
        except CONFIG_ERRORS as err:         # a constructor's own check (BERT: heads vs hidden size)
            raise invalid_config(f"{self.source or self.name} ({cls.__name__})", sorted(vars(config)),
                                 err) from err
        if attn == "flash_attention_2":
            model.config._attn_implementation = attn
        return model.train()

    def make_batch(self, config_or_model: transformers.PretrainedConfig | nn.Module, batch_size: int = 8, *,
                   seq_len: int | None = None, image_size: int | None = None, padded: bool = False,
                   task: str | None = None, seed: int = 0, device: str | torch.device = "cpu",
                   packing: bool = False) -> dict[str, torch.Tensor]:
        """A training batch for ``config_or_model`` such that ``model(**batch).loss`` is defined.

        The task defaults to the one whose class the given model is, else ``default_task``. See
        ``memfit.zoo._batches`` for the layout of each task's batch. ``packing=True`` (a causal
        LM): ``batch_size`` sequences of ``seq_len`` tokens flattened into one row of
        ``batch_size * seq_len`` tokens, as ``DataCollatorWithFlattening`` makes it
        (``memfit.zoo._packing``).
        """
        if isinstance(config_or_model, transformers.PretrainedConfig):
            config = config_or_model
        elif isinstance(config_or_model, nn.Module) and isinstance(
                getattr(config_or_model, "config", None), transformers.PretrainedConfig):
            config = config_or_model.config
            if task is None:
                task = self._task_of(config_or_model)
        else:
            raise ValueError(
                f"make_batch needs a transformers config or a model with a .config, got "
                f"{type(config_or_model).__name__}: pass spec.config(...) or the model spec.build(...) returned"
            )
        if packing:
            return self._packed_batch(config_or_model, config, self.check_task(task), batch_size,
                                      seq_len, padded, seed, device)
        return _batches.make_batch(config, self.check_task(task), batch_size, seq_len=seq_len,
                                   image_size=image_size, padded=padded, seed=seed, device=device)

    def _packed_batch(self, config_or_model, config, task, batch_size, seq_len, padded, seed,
                      device) -> dict[str, torch.Tensor]:
        """``batch_size`` sequences of ``seq_len`` tokens in one row (docs/packing.md)."""
        if padded:
            raise ValueError("packing removes the padding: ask for packing or for padded rows, "
                             "not both")
        model = config_or_model if isinstance(config_or_model, nn.Module) else None
        check_packable(model if model is not None else self.model_class(task), task)
        _batches.check_positive_int("batch_size", batch_size)
        seq_len = _batches.resolve_seq_len(config, task, seq_len)
        return packed_batch(config, [seq_len] * batch_size, seed=seed, device=device)

    def _task_of(self, model: nn.Module) -> str | None:
        cls_name = type(model).__name__
        return next((t for t, c in self.architectures.items() if c == cls_name), None)

    def _check_override_names(self, overrides: Mapping[str, Any]) -> None:
        if not overrides:
            return
        reference = self.config_class()
        known = set(vars(reference)) | set(self.config_values) | set(self.tiny_overrides)
        for key in overrides:
            if key not in known and not hasattr(reference, key):
                close = difflib.get_close_matches(key, sorted(known), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ValueError(f"unknown config field {key!r} for {self.config_class.__name__} ({self.name}){hint}")


ATTENTION = ("sdpa", "eager", "flash_attention_2")


def _check_attention(cls, attn: str | None) -> str | None:
    """``attn`` if ``cls`` has it (transformers' ``_supports_sdpa``, ``_supports_flash_attn``)."""
    if attn is None:
        return None
    if attn not in ATTENTION:
        raise ValueError(f"unknown attn_implementation {attn!r}: use one of {list(ATTENTION)}")
    flag = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn"}.get(attn)
    if flag and not getattr(cls, flag, False):
        raise ValueError(f"{cls.__name__} has no {attn} attention in this transformers: use "
                         f"eager{'' if attn == 'sdpa' else ' or sdpa'}")
    return attn


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements, each shared (tied) parameter counted once."""
    return sum(p.numel() for p in model.parameters())  # parameters() already skips duplicates
