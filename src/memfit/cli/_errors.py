"""How the command line shows errors and warnings: one line each, in the CLI's own words.

Note 1 (names). The API's messages name its keywords (``micro_batch_size=4``); a CLI user typed
``--micro-batch-size 4``. ``to_flags`` rewrites the keywords the CLI has a flag for, so an error
names what the user can change where they are. Only whole words are rewritten.

Note 2 (warnings). A library warning is shown once per message, as ``memfit: warning: ...``,
without the source line Python's default display prints (a line of memfit's code means nothing
to a CLI user). Deprecation notices from third-party libraries (transformers' FutureWarning
about its own API) are for their developers and are not shown.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings

__all__ = ["to_flags", "format_error", "cli_warnings", "is_user_error"]

# API spellings that have a CLI one, replaced as they are (Note 1)
_PHRASES = {
    "memfit.zoo.names()": "`memfit models`",
    "memfit.devices.list_devices()": "`memfit gpus`",
    "memfit.zoo.from_config_file(path)": "--config PATH",
    "memfit.largest_fitting(..., lever='seq_len')": "--seq-len auto",
    "memfit.largest_fitting(..., lever='batch_size')": "--batch-size auto",
    "requires_grad=False": "--freeze PATTERN",
    "LoRA adapters (peft)": "LoRA adapters (--lora-rank R)",
}
# API keyword -> CLI flag (Note 1)
_FLAGS = {
    "micro_batch_size": "--micro-batch-size", "offload_optimizer": "--offload-optimizer",
    "max_grad_norm": "--max-grad-norm", "optimizer_impl": "--optimizer-impl",
    "zero_grad": "--zero-grad", "optimizer_state": "--optimizer-state",
    "offload_params": "--offload-params",
    "reshard_after_forward": "--reshard-after-forward", "fsdp_offload": "--fsdp-offload",
    "mp_policy": "--mp-policy",
    "allocator": "--expandable-segments",
    "batch_size": "--batch-size", "seq_len": "--seq-len", "max_seq_len": "--seq-len",
    "image_size": "--image-size", "short_seq_len": "--progressive LEN",
    "short_fraction": "--progressive LEN:FRACTION", "budget_bytes": "--budget",
}
# keywords that are also plain English words: rewritten only as ``name=value``
_PLAIN_WORDS = {"precision": "--precision", "checkpoint": "--checkpoint", "offload": "--offload",
                "budget": "--budget", "remat": "--remat", "optimizer": "--optimizer",
                "device": "--gpu", "task": "--task", "gpus": "--gpus", "sharding": "--sharding"}
_NAMES = "|".join(sorted({**_FLAGS, **_PLAIN_WORDS}, key=len, reverse=True))
_ASSIGN = re.compile(r"(?<![\w.-])(" + _NAMES + r")=(?:'([^'\s]*)'|\"([^\"\s]*)\"|([\w.:+-]+))")
_KEYWORD = re.compile(r"(?<![\w.-])(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) +
                      r")\b")


def _flag(name: str) -> str:
    return _FLAGS.get(name) or _PLAIN_WORDS[name]


def _assignment(m: re.Match) -> str:
    name, value = m.group(1), next(g for g in m.groups()[1:] if g is not None)
    if name == "offload_optimizer":
        value = {"True": "on", "False": "off"}.get(value, value)
    return f"{_flag(name)} {value}"


def to_flags(message: str) -> str:
    """``"micro_batch_size=4 is larger than ..."`` -> ``"--micro-batch-size 4 is larger ..."``."""
    for api, cli in _PHRASES.items():
        message = message.replace(api, cli)
    message = _ASSIGN.sub(_assignment, message)
    return _KEYWORD.sub(lambda m: _FLAGS[m.group(1)], message)


def is_user_error(e: BaseException) -> bool:
    """Errors that describe bad input or a job that cannot fit, with the fix in the message:
    ValueError (BudgetTooSmall among them), OSError (files), memfit's own errors."""
    if isinstance(e, (ValueError, OSError)):
        return True
    errors = sys.modules.get("memfit.errors")      # loaded if memfit raised one of its own
    return errors is not None and isinstance(e, (errors.MemfitError, errors.OutOfMemory))


def format_error(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    text = text.removeprefix("memfit: ")
    return "memfit: error: " + to_flags(" ".join(text.split("\n")) if len(text) < 400 else text)


@contextlib.contextmanager
def cli_warnings(stream=None):
    """Show warnings once each, one line, in CLI words (Note 2)."""
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = to_flags(str(message).strip())
        if text in seen:
            return
        seen.add(text)
        print(f"memfit: warning: {text}", file=stream or sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        for category in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
            warnings.filterwarnings("ignore", category=category)
            warnings.filterwarnings("always", category=category, module=r"memfit(\.|$)")
        warnings.showwarning = show
        yield
