"""One error for a config that its transformers class refuses: the file, the field, the fix.

transformers 5 validates configs with huggingface_hub's strict dataclasses, which raise their
own errors ("Validation error for field 'hidden_size': TypeError: ...", "Class validation error
for validator 'validate_architecture': ValueError: The hidden size (65) is not a multiple of the
number of attention heads (4)."); older classes and model constructors raise ``ValueError`` or
``TypeError``. ``invalid_config`` turns any of them into one ``ValueError``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from huggingface_hub.errors import StrictDataclassError

__all__ = ["CONFIG_ERRORS", "invalid_config"]

CONFIG_ERRORS = (StrictDataclassError, TypeError, ValueError)
"""What a config class or a model constructor raises for a config it refuses."""


def invalid_config(where: str, fields: Iterable[str], err: Exception) -> ValueError:
    """A ``ValueError`` naming ``where`` (a file or a zoo name), the fields at fault and the fix."""
    text = str(err).strip()
    field = re.match(r"Validation error for field '([^']+)'", text)
    cause = (text.splitlines()[-1].strip() if "\n" in text else text).rstrip(".")
    named = [field.group(1)] if field else _fields_named_in(cause, fields)
    at = f" (field{'s' if len(named) > 1 else ''} {', '.join(map(repr, named))})" if named else ""
    return ValueError(f"{where}: the config is invalid{at}: {cause}. Fix the field"
                      f"{'s' if len(named) != 1 else ''} in the config (or the override) and retry.")


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
