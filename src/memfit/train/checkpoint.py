"""Checkpoints of a run: written atomically, verified when read, the previous one always kept.

Note 1 (atomic). A checkpoint is a folder ``checkpoints/step-NNNNNNN`` holding ``state.pt``
(model, optimizer, loss scaler, LR scheduler, RNG states, data position, the plan) and
``manifest.json`` (the step, the state file's size and SHA-256). It is written in full under a
temporary name, flushed to disk, and renamed into place (``os.replace`` on the same file
system: a reader sees the whole checkpoint or none). Only then are checkpoints beyond
``keep`` (oldest first) removed, so a crash, a full disk or Ctrl-C while writing leaves every
earlier checkpoint as it was; a leftover temporary folder is removed by the next save.

Note 2 (verified). ``load`` checks the manifest, the size and the SHA-256 before unpickling:
a truncated or altered file is reported as corrupt, naming the previous checkpoint (which is
kept, and can be resumed with ``--resume`` on it), and nothing is deleted.

Note 3 (bitwise resume). The RNG states (torch CPU and CUDA, Python's ``random``, NumPy's global
one) are saved after the step's optimizer update and restored right before the next step, once the
model, optimizer and plan are rebuilt; the data order is a function of ``(seed, epoch)``, so a
position is two integers (the epoch, the batches done). So the resumed run draws the same dropout
masks and sees the same batches as the uninterrupted one, and its parameters are equal bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil

import numpy as np
import torch

__all__ = ["save", "load", "latest", "list_checkpoints", "rng_state", "set_rng_state"]

_PREFIX = "step-"


def rng_state() -> dict:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate(),
            "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def list_checkpoints(folder: str) -> list[str]:
    """The run's checkpoint folders, oldest first."""
    root = os.path.join(folder, "checkpoints")
    if not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if n.startswith(_PREFIX) and n[5:].isdigit())
    return [os.path.join(root, n) for n in names]


def latest(folder: str) -> str | None:
    found = list_checkpoints(folder)
    return found[-1] if found else None


def save(folder: str, step: int, state: dict, keep: int = 2) -> str:
    """Write ``state`` as the checkpoint of ``step`` (Note 1); returns its folder."""
    root = os.path.join(folder, "checkpoints")
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):              # a previous save that did not finish
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    final = os.path.join(root, f"{_PREFIX}{step:07d}")
    tmp = os.path.join(root, f".tmp-{_PREFIX}{step:07d}")
    os.makedirs(tmp)
    path = os.path.join(tmp, "state.pt")
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    manifest = {"step": step, "state_bytes": os.path.getsize(path), "sha256": _sha256(path)}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):                  # the same step saved again (end after a save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(path: str) -> str:
    """``--resume PATH``: a run folder (its latest checkpoint) or one checkpoint folder."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume {path}: no such folder")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    found = latest(path)
    if found is None:
        raise ValueError(f"--resume {path}: no checkpoint there (a run folder holds them under "
                         "checkpoints/step-N; it has none yet)")
    return found


def _previous(ckpt: str) -> str | None:
    run = os.path.dirname(os.path.dirname(os.path.abspath(ckpt)))
    older = [c for c in list_checkpoints(run) if os.path.abspath(c) < os.path.abspath(ckpt)]
    return older[-1] if older else None


def load(ckpt: str) -> dict:
    """The state of checkpoint folder ``ckpt``, verified first (Note 2)."""
    def corrupt(why: str):
        prev = _previous(ckpt)
        keep = (f"the previous checkpoint {prev} is intact: resume from it with --resume {prev}"
                if prev else "there is no earlier checkpoint of this run")
        return ValueError(f"checkpoint {ckpt} is corrupt ({why}); nothing was changed; {keep}")
    try:
        with open(os.path.join(ckpt, "manifest.json")) as f:
            manifest = json.load(f)
        path = os.path.join(ckpt, "state.pt")
        size = os.path.getsize(path)
    except (OSError, ValueError) as e:
        raise corrupt(f"{type(e).__name__}: {e}") from None
    if size != manifest.get("state_bytes"):
        raise corrupt(f"state.pt has {size} bytes, the manifest says {manifest.get('state_bytes')}")
    if _sha256(path) != manifest.get("sha256"):
        raise corrupt("state.pt does not match the SHA-256 in its manifest")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:     # unpickling errors have many types; the file is not usable
        raise corrupt(f"{type(e).__name__}: {e}") from e
