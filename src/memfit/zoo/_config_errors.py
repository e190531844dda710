"""One error for a config that its transformers class refuses: the file, the field, the fix.

transformers 5 validates configs with huggingface_hub's strict dataclasses, which raise their
own errors ("Validation error for field 'hidden_size': TypeError: ...", "Class validation error
for validator 'validate_architecture': ValueError: The hidden size (65) is not a multiple of the
number of attention heads (4)."); older classes and model constructors raise ``ValueError`` or
``TypeError``. ``invalid_config`` turns any of them into one ``ValueError``.

Some sizes no class checks: ``num_hidden_layers: -2`` builds ``ModuleList(range(-2))`` (empty,
or "__len__() should return >= 0" where a class takes its length), ``hidden_size: -8`` fails
in ``torch.empty``. ``check_sizes`` refuses a size field (``SIZE_FIELDS``: layer, width, head,
feed-forward and vocabulary counts, by every name transformers' configs give them) that is not
a positive int (some derived sizes may be 0), in the config and its sub-configs, naming the
field. ``None`` stays allowed (GPT-2's ``n_inner``, ``num_key_value_heads``: "derive it").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from huggingface_hub.errors import StrictDataclassError

__all__ = ["CONFIG_ERRORS", "SIZE_FIELDS", "check_sizes", "invalid_config"]

CONFIG_ERRORS = (StrictDataclassError, TypeError, ValueError)
"""What a config class or a model constructor raises for a config it refuses."""

SIZE_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers",
               "decoder_layers", "hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head",
               "num_heads", "num_key_value_heads", "encoder_attention_heads", "decoder_attention_heads",
               "intermediate_size", "n_inner", "d_ff", "d_kv", "head_dim", "encoder_ffn_dim",
               "decoder_ffn_dim", "vocab_size")
"""Fields that count layers, widths, heads or tokens: positive where set (sizes no class checks,
see above; a list or dict, as Swin's per-stage ``num_heads``, in every entry). Derived sizes may
be 0 (``_ZERO_ALLOWED``: a default that means "unused" or "derive it", GLM's ``head_dim=0``)."""
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder")
_ZERO_ALLOWED = ("head_dim", "d_kv", "n_inner", "intermediate_size", "d_ff", "encoder_ffn_dim",
                 "decoder_ffn_dim", "num_key_value_heads")


def check_sizes(where: str, config) -> None:
    """Raise ``ValueError`` for a ``SIZE_FIELDS`` value of ``config`` (or of a sub-config, e.g.
    CLIP's ``text_config``) that is set but out of range (sizes no class checks). ``config``: a
    config, or the keyword values it is about to be built from (checked first: a class's own
    validator may otherwise speak of another field, "hidden size (-8) is not a multiple of the
    heads")."""
    raw = isinstance(config, Mapping)
    own = config if raw else vars(config)
    for name in SIZE_FIELDS:
        value = own.get(name)
        # Swin: one per stage; LXMERT: one per encoder
        values = list(value.values()) if isinstance(value, dict) else \
            value if isinstance(value, (list, tuple)) else [value]
        low = 0 if name in _ZERO_ALLOWED else 1
        if raw and not all(_at_least(v, -2**63) for v in values):
            continue          # not an int: the class's own check names the type it expects
        if value is not None and not all(_at_least(v, low) for v in values):
            kind = "a positive int" if low else "an int >= 0"
            raise ValueError(f"{where}: the config is invalid (field {name!r}): {name} must be "
                             f"{kind}{' per entry' if len(values) > 1 else ''}, got {value!r}. Fix "
                             "the field in the config (or the override) and retry.")
    for name, value in own.items():
        sub = isinstance(value, Mapping) or (hasattr(value, "to_dict") and hasattr(value, "model_type"))
        if sub and value is not config and name in _SUB_CONFIGS:
            check_sizes(f"{where} ({name})", value)


def invalid_config(where: str, fields: Iterable[str], err: Exception) -> ValueError:
    """A ``ValueError`` naming ``where`` (a file or a zoo name), the fields at fault and the fix."""
    text = str(err).strip()
    field = re.match(r"Validation error for field '([^']+)'", text)
    cause = (text.splitlines()[-1].strip() if "\n" in text else text).rstrip(".")
    named = [field.group(1)] if field else _fields_named_in(cause, fields)
    at = f" (field{'s' if len(named) > 1 else ''} {', '.join(map(repr, named))})" if named else ""
    return ValueError(f"{where}: the config is invalid{at}: {cause}. Fix the field"
                      f"{'s' if len(named) != 1 else ''} in the config (or the override) and retry.")


def _at_least(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _fields_named_in(message: str, fields: Iterable[str]) -> list[str]:
    """Config fields the message speaks of ("hidden size" -> hidden_size, "attention heads" ->
    num_attention_heads)."""
    lower = message.lower()
    out = []
    for name in fields:
        words = name.lower().replace("_", " ")
        if words in lower or (words.startswith("num ") and words[4:] in lower):
            out.append(name)
    return out
