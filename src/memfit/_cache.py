"""A content-addressed cache on disk: bytes stored under a key that hashes what decides them.

    cache = Cache(default_folder(os.environ))     # the front reads the environment, once
    key = key_of(figure="parameters", config=config_dict, transformers="5.24.0")
    data = cache.get(key)                         # the bytes, or None: a miss
    if data is None:
        data = compute()
        cache.put(key, data)

docs/cache.md says what memfit keeps here and how to size or clear it (``memfit cache``).

Note 1 (keys). A key is the SHA-256 of the canonical JSON of its parts (keys sorted, no
spaces), so the same parts give the same key in any process and in any keyword order. A part
that is not JSON (a tensor, a class, a set) is refused, not hashed by its id: the caller names
what decides the value (a config's dict, a library's version, a list of shapes). A value is
never invalidated: a change in any part is another key, and the old entry ages out (Note 3).

Note 2 (files, concurrent runs). An entry is one file, ``<folder>/v1/<key[:2]>/<key>``: a
header (a magic line, the SHA-256 of the payload) then the payload. ``put`` writes a temporary
file in the entry's folder and renames it over the entry (``os.replace``, atomic on POSIX and
Windows), so a reader sees the old file, the new one or none, never a part of one; runs that
write the same key at once leave one whole entry (the last rename's). A file whose header or
checksum does not match (a write cut short by a crash or a full disk, a disk error, a hand
edit) is a miss, and is removed.

Note 3 (size). ``limit_bytes`` caps the bytes of all entries. A hit sets its file's
modification time to now; after a ``put`` that leaves the cache above the limit, the entries
least recently written or read are removed until it is under. A value larger than the limit is
not stored. Temporary files more than an hour old (a run killed mid-write) go in the same pass.

Note 4 (failures). The cache only saves time, so it never fails a run: a folder that cannot be
read or written (read-only, full disk) gives one warning, and the value is computed as it is
without a cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Cache", "CacheInfo", "DEFAULT_LIMIT_BYTES", "key_of", "default_folder"]

DEFAULT_LIMIT_BYTES = 1 << 30      # 1 GiB (Note 3)
_LAYOUT = "v1"                     # the folder of this file layout (Note 2)
_MAGIC = b"memfit-cache 1\n"
_DIGEST_BYTES = 32                 # SHA-256
_TEMP_PREFIX = ".tmp-"
_STALE_TEMP_S = 3600.0             # seconds after which a temporary file is a dead run's
_KEY = re.compile(r"^[0-9a-f]{64}$")


def key_of(**parts) -> str:
    """The key of the value that ``parts`` decide (Note 1): 64 hex digits."""
    if not parts:
        raise ValueError("key_of needs the parts that decide the value, e.g. "
                         "key_of(config=config.to_dict(), torch=torch.__version__)")
    try:
        text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except TypeError as e:
        raise TypeError(f"key_of: every part must be JSON (dict, list, str, number, bool, "
                        f"None): {e}; pass what decides the value instead, e.g. a config's "
                        "dict or a version string") from None
    return hashlib.sha256(text.encode()).hexdigest()


def default_folder(environ: Mapping[str, str]) -> Path:
    """``$MEMFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/memfit``, else ``~/.cache/memfit``;
    ``environ`` is the front's (``os.environ``): nothing below a front reads the environment."""
    if environ.get("MEMFIT_CACHE_DIR"):
        return Path(environ["MEMFIT_CACHE_DIR"]).expanduser()
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]).expanduser() / "memfit"
    return Path("~/.cache/memfit").expanduser()


@dataclass(frozen=True)
class CacheInfo:
    """What a cache folder holds."""

    folder: Path        # the folder given to Cache
    entries: int        # values stored
    size_bytes: int     # bytes of their files, headers included (what limit_bytes caps)
    limit_bytes: int    # the cap (Note 3)


class Cache:
    """Values under keys (``key_of``) in ``folder``, at most ``limit_bytes`` in all."""

    def __init__(self, folder: str | os.PathLike, limit_bytes: int = DEFAULT_LIMIT_BYTES):
        if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ValueError(f"limit_bytes must be a whole number of bytes >= 0, got "
                             f"{limit_bytes!r} (0 stores nothing)")
        self.folder = Path(folder)
        self.limit_bytes = limit_bytes
        self._root = self.folder / _LAYOUT
        self._warned = False

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or None (not stored, evicted, or corrupt: Note 2)."""
        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self._warn(f"cannot read {path} ({e})")
            return None
        payload = _unpack(blob)
        if payload is None:             # Note 2: a bad file is a miss, and goes
            _remove(path)
            return None
        try:
            os.utime(path)              # Note 3: used now
        except OSError:                 # evicted by another run since, or a read-only
            pass                        # cache: the bytes read are whole either way
        return payload

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (Note 2), then keep the cache under its limit."""
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"Cache.put stores bytes, got {type(value).__name__}: encode it "
                            "(json.dumps(...).encode(), pickle.dumps(...))")
        path = self._path(key)
        blob = _pack(bytes(value))
        if len(blob) > self.limit_bytes:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_atomically(path, blob)
        except OSError as e:
            self._warn(f"cannot write {path.parent} ({e})")
            return
        self._evict()

    def info(self) -> CacheInfo:
        entries = self._entries()
        return CacheInfo(self.folder, len(entries), sum(size for _, size, _ in entries),
                         self.limit_bytes)

    def clear(self) -> int:
        """Remove every entry; the number removed."""
        entries = self._entries()
        for _, _, path in entries:
            _remove(path)
        for sub in _subfolders(self._root):
            with contextlib.suppress(OSError):      # not empty: another run is writing there
                sub.rmdir()
        return len(entries)

    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"{key!r} is not a cache key: make one with key_of(**parts)")
        return self._root / key[:2] / key

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of each entry; dead runs' temporary files removed (Note 3)."""
        out, now = [], time.time()
        for sub in _subfolders(self._root):
            for path in _children(sub):
                try:
                    st = path.stat()
                except FileNotFoundError:           # removed by another run meanwhile
                    continue
                if not path.name.startswith(_TEMP_PREFIX):
                    out.append((st.st_mtime, st.st_size, path))
                elif now - st.st_mtime > _STALE_TEMP_S:
                    _remove(path)
        return out

    def _evict(self) -> None:
        """Least recently used entries out until the cache is under its limit (Note 3)."""
        entries = self._entries()
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.limit_bytes:
                break
            _remove(path)
            total -= size

    def _warn(self, what: str) -> None:
        if not self._warned:            # Note 4: once per cache
            self._warned = True
            warnings.warn(f"memfit's cache at {self.folder}: {what}; going on without it "
                          "(set MEMFIT_CACHE_DIR to a writable folder, or pass --no-cache)",
                          stacklevel=3)


def _pack(payload: bytes) -> bytes:
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def _unpack(blob: bytes) -> bytes | None:
    """The payload of a whole entry file, None for anything else (Note 2)."""
    head = len(_MAGIC) + _DIGEST_BYTES
    if len(blob) < head or not blob.startswith(_MAGIC):
        return None
    payload = blob[head:]
    return payload if hashlib.sha256(payload).digest() == blob[len(_MAGIC):head] else None


def _write_atomically(path: Path, blob: bytes) -> None:
    """A temporary file beside ``path``, renamed over it (Note 2)."""
    fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(temp, path)
    except BaseException:
        _remove(Path(temp))
        raise


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):    # another run removed it first
        path.unlink()


def _children(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # cleared by another run meanwhile, or
        return []                                    # never made (Note 4)


def _subfolders(root: Path) -> list[Path]:
    return [p for p in _children(root) if p.is_dir()]
