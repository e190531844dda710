"""How the command line shows errors and warnings: one line each, in the CLI's own words.

Note 1 (names). The API's messages name its keywords (``micro_batch_size=4``); a CLI user typed
``--micro-batch-size 4``. ``to_flags`` rewrites the keywords the CLI has a flag for, so an error
names what the user can change where they are. Only whole words are rewritten.

Note 2 (warnings). A library warning is shown once per message, as ``memfit: warning: ...``,
without the source line Python's default display prints (a line of memfit's code means nothing
to a CLI user). Deprecation notices from third-party libraries (transformers' FutureWarning
about its own API) are for their developers and are not shown.

Note 3 (only this command's flags). A rewrite happens only where the command printing the
message has every flag it names (``memfit train`` has no ``--lora-rank``): elsewhere the API's
words stay, which name the fix without sending the user to a flag that is not there.

Note 4 (shapes). An error keeps its lines (``BudgetTooSmall`` is a verdict, then one lever a
line); under ``--json`` it is one JSON object on stdout (``error``, ``type``, and the numbers
an error carries), so a program reading stdout gets JSON whatever happened.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings

__all__ = ["to_flags", "format_error", "error_text", "error_json", "cli_warnings",
           "is_user_error"]

# API spellings that have a CLI one, replaced as they are (Note 1)
_PHRASES = {
    "memfit.zoo.names()": "`memfit models`",
    "memfit.devices.list_devices()": "`memfit gpus`",
    "memfit.zoo.from_config_file(path)": "--config PATH",
    "memfit.zoo.from_pretrained_config('org/name')": "--model ORG/NAME",
    "memfit.largest_fitting(..., lever='seq_len')": "--seq-len auto",
    "memfit.largest_fitting(..., lever='batch_size')": "--batch-size auto",
    "requires_grad=False": "--freeze PATTERN",
    "LoRA adapters (peft)": "LoRA adapters (--lora-rank R)",
    "a lower LoRA rank or fewer target modules": "a lower --lora-rank or fewer --lora-targets",
    "QLoRA (memfit.techniques.QuantizedBase, then peft's LoRA)":
        "QLoRA (--quantize nf4 --lora-rank R)",
    # a policy's block names are the Python API's only: the flags take the policies
    "or a tuple of block names": "or, in Python, a tuple of block names",
}
# API keyword -> CLI flag (Note 1)
_FLAGS = {
    "micro_batch_size": "--micro-batch-size", "offload_optimizer": "--offload-optimizer",
    "max_grad_norm": "--max-grad-norm", "optimizer_impl": "--optimizer-impl",
    "zero_grad": "--zero-grad", "optimizer_state": "--optimizer-state",
    "offload_params": "--offload-params", "chunked_loss": "--chunked-loss",
    "optimizer_in_backward": "--optimizer-in-backward", "offload_gradients": "--offload-gradients",
    "reshard_after_forward": "--reshard-after-forward", "fsdp_offload": "--fsdp-offload",
    "mp_policy": "--mp-policy",
    "allocator": "--expandable-segments",
    "batch_size": "--batch-size", "seq_len": "--seq-len", "max_seq_len": "--seq-len",
    "image_size": "--image-size", "short_seq_len": "--progressive LEN",
    "short_fraction": "--progressive LEN:FRACTION", "budget_bytes": "--budget",
    "attn_implementation": "--attn-implementation",
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


_SWITCHES = {"offload_optimizer", "fsdp_offload", "reshard_after_forward", "offload_gradients",
             "optimizer_in_backward"}   # flags of on|off


def _assignment(m: re.Match) -> str:
    """``name=value`` -> ``--flag value``, a Python True/False as the flag says it."""
    name, value = m.group(1), next(g for g in m.groups()[1:] if g is not None)
    tail = ":" if value.endswith(":") else ""         # "needs offload_optimizer=True: ..."
    value = value[:len(value) - len(tail)]
    if name in _SWITCHES:
        value = {"True": "on", "False": "off"}.get(value, value)
    elif name == "remat" and value in ("True", "False"):
        return ("--remat" if value == "True" else "no --remat") + tail
    return f"{_flag(name)} {value}{tail}"


def to_flags(message: str, flags=None, bare: bool = True) -> str:
    """``"micro_batch_size=4 is larger than ..."`` -> ``"--micro-batch-size 4 is larger ..."``.
    ``flags``: the option strings of the command printing it (Note 3); None: every command's.
    ``bare=False``: only ``name=value`` and the phrases (prose such as a plan's explanation,
    where "allocator" is a word, not a keyword)."""
    def has(cli: str) -> bool:
        named = re.findall(r"--[\w-]+", cli)
        return flags is None or all(f in flags for f in named)

    for api, cli in _PHRASES.items():
        if has(cli):
            message = message.replace(api, cli)
    message = _ASSIGN.sub(lambda m: _assignment(m) if has(_flag(m.group(1))) else m.group(0),
                          message)
    if not bare:
        return message
    return _KEYWORD.sub(lambda m: _FLAGS[m.group(1)] if has(_FLAGS[m.group(1)]) else m.group(0),
                        message)


def is_user_error(e: BaseException) -> bool:
    """Errors that describe bad input or a job that cannot fit, with the fix in the message:
    ValueError (BudgetTooSmall among them), OSError (files), memfit's own errors."""
    if isinstance(e, (ValueError, OSError)):
        return True
    errors = sys.modules.get("memfit.errors")      # loaded if memfit raised one of its own
    return errors is not None and isinstance(e, (errors.MemfitError, errors.OutOfMemory))


def error_text(e: BaseException, flags=None) -> str:
    """The message of ``e`` in the CLI's words (Notes 1, 3), its lines kept (Note 4)."""
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    return to_flags(text.removeprefix("memfit: "), flags)


def format_error(e: BaseException, flags=None) -> str:
    return "memfit: error: " + error_text(e, flags)


def error_json(e: BaseException, flags=None) -> dict:
    """The error as ``--json`` prints it (Note 4): one object, the numbers as numbers."""
    out = {"error": error_text(e, flags), "type": type(e).__name__}
    for name in ("floor_bytes", "budget_bytes", "floor_is_bound"):
        if getattr(e, name, None) is not None:
            out[name] = getattr(e, name)
    return out


@contextlib.contextmanager
def cli_warnings(stream=None, flags=None):
    """Show warnings once each, one line, in CLI words (Note 2); ``flags``: the command's
    (Note 3)."""
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = to_flags(str(message).strip(), flags)
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
