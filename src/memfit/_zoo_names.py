"""Which model a ``--model`` string names, answered without torch or transformers: a built-in
model's row (``memfit._zoo_table``) by name or alias, a config file, or a hub id.

``memfit.zoo`` resolves strings to specs through these functions (``zoo._registry``,
``zoo._hub``, ``zoo._config_file``), so the CLI can refuse a name that is none of these before
it imports torch, in the words the zoo would use.

Note 1 (which model a string names). ``model_source`` reads a string in this order: a
built-in name or alias first (``gpt2``, ``openai-community/gpt2``: memfit's own copy of the
config, no hub); then an existing file or folder (a config.json); then a hub id, one ``/``
between two valid names (``meta-llama/Llama-3.1-8B``). A string that is none of these gets
the zoo's error, which lists the built-in names. A name ending in ``.json`` is a path, never a
hub id: a missing file is said to be missing. A ``revision`` asks for the hub, so a hub id that
is also a built-in alias (``openai-community/gpt2``) is then read from the hub; with a
built-in short name or a path it is refused (it would have no effect).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from memfit._zoo_table import ROWS, Row

__all__ = ["names", "find_row", "unknown_model", "check_task", "is_hub_id", "model_source",
           "config_file"]

_BY_NAME = {key.lower(): row for row in ROWS for key in (row.name, *row.aliases)}
assert len(_BY_NAME) == sum(1 + len(r.aliases) for r in ROWS), "a zoo name or alias is used twice"


def names() -> list[str]:
    """Canonical names of the built-in models."""
    return [row.name for row in ROWS]


def find_row(name: str) -> Row | None:
    """The built-in model called ``name`` (canonical name or alias, case-insensitive), or None."""
    return _BY_NAME.get(str(name).strip().lower())


def unknown_model(name: str) -> ValueError:
    """The error for a name that is no built-in model, with the closest names."""
    key = str(name).strip().lower()
    close = difflib.get_close_matches(key, list(_BY_NAME), n=5, cutoff=0.5)
    suggestions = list(dict.fromkeys(_BY_NAME[c].name for c in close))[:3]  # canonical, deduplicated
    hint = f" Did you mean {', '.join(map(repr, suggestions))}?" if suggestions else ""
    return ValueError(
        f"unknown model {name!r}.{hint} memfit.zoo.names() lists the built-in models; "
        "memfit.zoo.from_config_file(path) reads any Hugging Face config.json, and "
        "memfit.zoo.from_pretrained_config('org/name') a hub model's."
    )


def check_task(model: str, tasks, task: str) -> None:
    """ValueError naming the valid ``tasks`` of ``model`` when ``task`` is not one of them."""
    if task not in tasks:
        raise ValueError(f"unknown task {task!r} for {model}: valid tasks are {list(tasks)}")


def is_hub_id(text: str) -> bool:
    """``"org/name"``: one ``/`` between two names the hub accepts, and not a ``.json`` path."""
    if text.count("/") != 1 or text.lower().endswith(".json"):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def model_source(model: str, revision: str | None = None) -> str:
    """Where ``model`` is read from (Note 1): "builtin", "path" or "hub"; ValueError for a
    string that names none of them, or a ``revision`` where it has no effect."""
    row = find_row(model)
    path = Path(model).expanduser()
    hub = is_hub_id(model) and not path.exists()
    if revision is not None and not hub:
        source = f" ({row.source})" if row is not None and is_hub_id(row.source) else ""
        kind = "a built-in model" if row is not None else "a local path" if path.exists() \
            else "not a hub id"
        raise ValueError(f"revision {revision!r} picks a commit of a hub repo, and {model!r} is "
                         f"{kind}: drop the revision, or give the hub id{source} with it")
    if row is not None and revision is None:
        return "builtin"
    if path.exists():
        return "path"
    if hub:
        return "hub"
    if model.lower().endswith(".json") or "/" in model or "\\" in model:
        raise ValueError(f"no file or folder at {model!r}, and it is not a built-in model's name "
                         "or a hub id (organisation/name): check the path")
    raise unknown_model(model)


def config_file(path: str | Path) -> Path:
    """The config.json a path names (the file, or a folder holding one); ValueError if none."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config file at {file}: pass the path of a Hugging Face config.json "
                         "or of a directory that holds one")
    return file
