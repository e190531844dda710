"""``from_pretrained_config``: a ``ModelSpec`` for a model on the Hugging Face hub, from its
``config.json`` alone; ``resolve``: the spec a ``--model`` string names.

Note 1 (the cache first, config.json only). The file comes from huggingface_hub's cache (the
folder ``HF_HUB_CACHE`` names, laid out ``models--org--name/refs/<revision>`` ->
``snapshots/<commit>/config.json``) when it is there: a cached config is used without asking
the hub, so an estimate runs on a machine without network and never waits on one. Only when
it is not cached is ``hf_hub_download`` asked for that one file (a few KB; never a weight
file); with ``HF_HUB_OFFLINE=1`` (huggingface_hub's own switch, read by huggingface_hub) or
``local_files_only=True`` it is not asked at all. A ``revision`` (branch, tag or commit hash)
is looked up in the cache as huggingface_hub stores it; ``None`` is the repo's main branch. A
config cached for ``main`` stays as it was downloaded: ``hf download org/name config.json``
refreshes it.

Note 2 (errors). Each failure is one ``HubConfigError`` naming the id and the revision, with
what to do: not cached while offline (names ``HF_HUB_OFFLINE`` and the cache folder), not
cached and the hub unreachable, a gated repo (ask for access on its page, then ``hf auth
login`` or ``HF_TOKEN``), a repo that does not exist (or that this token cannot see), a
revision it does not have, a repo without a ``config.json``. huggingface_hub's exception is
kept as the ``__cause__``.

Note 3 (no network). Where the hub's host name does not resolve (no network, no DNS) and no
proxy is set to resolve it, the download is not tried: huggingface_hub would retry the
connection for about 27 s before the same error.

Which model a string names (a built-in name first, then a path, then a hub id) is
``memfit._zoo_names.model_source``'s answer, which ``resolve`` follows.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import huggingface_hub
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                    OfflineModeIsEnabled, RemoteEntryNotFoundError,
                                    RepositoryNotFoundError, RevisionNotFoundError)

from memfit._zoo_names import is_hub_id, model_source
from memfit.zoo._config_file import from_config_file
from memfit.zoo._registry import get
from memfit.zoo._spec import ModelSpec

__all__ = ["HubConfigError", "from_pretrained_config", "hub_error_message", "is_hub_id", "resolve"]

_CONFIG = "config.json"


class HubConfigError(OSError):
    """A hub model's ``config.json`` could not be read (Note 2): the message names the id, the
    revision and the next step; huggingface_hub's own error is the ``__cause__``."""


def from_pretrained_config(repo_id: str, revision: str | None = None, *, task: str | None = None,
                           cache_dir: str | Path | None = None,
                           local_files_only: bool = False) -> ModelSpec:
    """A spec built from the ``config.json`` of the hub model ``repo_id`` (``"org/name"``).

    Only that file is read: from the cache when it is there, else downloaded (Note 1); no weight
    is ever fetched. ``spec.build(device="meta")`` then gives the full-size model with random
    weights and no memory. ``revision``: a branch, tag or commit hash (default: main).
    ``cache_dir``: huggingface_hub's cache folder (default: ``HF_HUB_CACHE``).
    ``local_files_only``: never ask the hub (as ``HF_HUB_OFFLINE=1`` does). ``task`` picks the
    head as in ``from_config_file``. The spec's ``name`` is ``repo_id``; its ``source``
    ``repo_id@commit``. Raises ``HubConfigError`` (Note 2).
    """
    if not isinstance(repo_id, str) or not is_hub_id(repo_id):
        raise ValueError(f"{repo_id!r} is not a hub model id: write organisation/name as in the "
                         "model page's address, e.g. 'meta-llama/Llama-3.1-8B'")
    file = Path(_config_path(repo_id, revision, cache_dir, local_files_only))
    spec = from_config_file(file, task=task)
    return dataclasses.replace(spec, name=repo_id, source=f"{repo_id}@{file.parent.name}")


def resolve(model: str, *, revision: str | None = None, task: str | None = None,
            cache_dir: str | Path | None = None) -> ModelSpec:
    """The spec ``model`` names: a built-in name, a config.json path, or a hub id, read in
    that order (``memfit._zoo_names.model_source``). ``revision`` applies to a hub id only and
    is refused with the others."""
    source = model_source(model, revision)
    if source == "builtin":
        return get(model)
    if source == "path":
        return from_config_file(Path(model).expanduser(), task=task)
    return from_pretrained_config(model, revision, task=task, cache_dir=cache_dir)


def _config_path(repo_id: str, revision: str | None, cache_dir, local_files_only: bool) -> str:
    """The local path of the repo's config.json: the cached one, else downloaded (Note 1)."""
    cached = huggingface_hub.try_to_load_from_cache(repo_id, _CONFIG, cache_dir=cache_dir,
                                                    revision=revision)
    if isinstance(cached, str):          # not None, nor the "known not to exist" marker
        return cached
    offline = "HF_HUB_OFFLINE=1" if hub_constants.is_offline_mode() else \
        "local_files_only=True" if local_files_only else None
    if offline is not None:
        raise HubConfigError(_not_cached(repo_id, revision, cache_dir, offline))
    unresolved = _unresolved_host()                                    # Note 3
    if unresolved is not None:
        raise HubConfigError(_unreachable(repo_id, revision, cache_dir, unresolved)) \
            from unresolved
    try:
        return huggingface_hub.hf_hub_download(repo_id, _CONFIG, revision=revision,
                                               cache_dir=cache_dir)
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        raise HubConfigError(hub_error_message(err, repo_id, revision, cache_dir)) from err


def _unresolved_host() -> OSError | None:
    """Note 3: the error resolving the hub's host name, where no proxy resolves it for us."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(hub_constants.ENDPOINT).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except socket.gaierror as err:
        return err
    return None


def _where(repo_id: str, revision: str | None) -> str:
    return repo_id if revision is None else f"{repo_id} at revision {revision!r}"


def _cache_folder(cache_dir) -> str:
    return str(cache_dir if cache_dir is not None else hub_constants.HF_HUB_CACHE)


def _download_hint(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision is not None else ""
    return f"`hf download {repo_id} config.json{rev}`"


def _not_cached(repo_id: str, revision: str | None, cache_dir, why: str) -> str:
    return (f"{_where(repo_id, revision)}: its config.json is not in the Hugging Face cache "
            f"({_cache_folder(cache_dir)}), and {why} keeps memfit off the hub: unset it to "
            f"download that one file (a few KB, no weights), or fetch it where the hub is "
            f"reachable ({_download_hint(repo_id, revision)}) and copy the cache folder here")


def hub_error_message(err: Exception, repo_id: str, revision: str | None, cache_dir=None) -> str:
    """What a huggingface_hub error on ``repo_id``'s config.json means for the user (Note 2)."""
    where = _where(repo_id, revision)
    page = f"https://huggingface.co/{repo_id}"
    if isinstance(err, GatedRepoError):
        return (f"{repo_id} is a gated model: its files, config.json too, are served only to "
                f"accounts that accepted its terms. Ask for access on {page}, then log in with "
                "`hf auth login` (or set HF_TOKEN to a token of that account) and run again")
    if isinstance(err, RepositoryNotFoundError):
        return (f"no model {repo_id!r} on the Hugging Face hub (or it is private and this "
                "machine's token cannot see it): check the spelling, organisation/name as in the "
                "model page's address; for a private model log in with `hf auth login` or set "
                "HF_TOKEN; memfit.zoo.names() lists the built-in models")
    if isinstance(err, RevisionNotFoundError):
        return (f"{repo_id} has no revision {revision or 'main'!r}: give a branch, tag or commit "
                f"hash it has (listed under 'Files and versions' on {page})")
    if isinstance(err, RemoteEntryNotFoundError):
        return (f"{where} has no config.json, so it is not a transformers model memfit can "
                "build (an adapter-only or GGUF repo?): name the base model's repo instead")
    if isinstance(err, OfflineModeIsEnabled):
        return _not_cached(repo_id, revision, cache_dir, "HF_HUB_OFFLINE=1")
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else "an error"
        return (f"{where}: the hub answered {status} for its config.json "
                f"({str(err).splitlines()[0]}); try again later, or log in (`hf auth login`) "
                "if the repo is private")
    return _unreachable(repo_id, revision, cache_dir, err.__cause__)


def _unreachable(repo_id: str, revision: str | None, cache_dir, cause) -> str:
    where = _where(repo_id, revision)
    reason = f" ({cause})" if cause is not None else ""
    return (f"{where}: its config.json is not in the Hugging Face cache ({_cache_folder(cache_dir)}) "
            f"and the hub could not be reached{reason}: check the network (or HF_ENDPOINT and the "
            f"proxy), or fetch it where the hub is reachable ({_download_hint(repo_id, revision)}) "
            "and copy the cache folder here; HF_HUB_OFFLINE=1 skips the hub's retries")
