"""memfit._cache: content-addressed entries on disk, whole under concurrent writers, bounded.

The oracles are the file system and other processes: what a second ``Cache`` on the same folder
reads, what two real processes writing one key leave behind, which files are left after an
eviction. Nothing here imports torch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memfit._cache import Cache, default_folder, key_of
from memfit._versions import library_version, torch_build


def _files(cache: Cache) -> list[Path]:
    return sorted(p for p in cache.folder.rglob("*") if p.is_file())


def _age(cache: Cache, key: str, seconds_ago: float) -> None:
    """Make the entry of ``key`` last used ``seconds_ago`` (its file's modification time)."""
    (path,) = [p for p in _files(cache) if p.name == key]
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def test_a_key_hashes_what_decides_the_value_in_any_order():
    a = key_of(config={"hidden": 64, "layers": 2}, torch="2.13.0")
    assert a == key_of(torch="2.13.0", config={"layers": 2, "hidden": 64})
    assert a != key_of(config={"hidden": 64, "layers": 3}, torch="2.13.0")
    assert a != key_of(config={"hidden": 64, "layers": 2}, torch="2.13.1")
    assert len(a) == 64 and int(a, 16) >= 0
    with pytest.raises(TypeError, match="must be JSON"):
        key_of(shape={1, 2})
    with pytest.raises(ValueError, match="needs the parts"):
        key_of()


def test_a_value_put_is_read_back_by_another_cache_on_the_folder(tmp_path):
    key, other = key_of(n=1), key_of(n=2)
    Cache(tmp_path).put(key, b"\x00value\xff")
    again = Cache(tmp_path)
    assert again.get(key) == b"\x00value\xff"
    assert again.get(other) is None
    assert again.info().entries == 1
    with pytest.raises(ValueError, match="not a cache key"):
        again.get("../../etc/passwd")
    with pytest.raises(TypeError, match="stores bytes"):
        again.put(other, "text")


def test_the_least_recently_used_entries_go_past_the_limit(tmp_path):
    keys = [key_of(n=i) for i in range(4)]
    cache = Cache(tmp_path, limit_bytes=10**9)
    cache.put(keys[0], b"x" * 1000)
    entry_bytes = cache.info().size_bytes            # the payload and the header
    cache = Cache(tmp_path, limit_bytes=3 * entry_bytes)
    for i, key in enumerate(keys[1:3], start=1):
        cache.put(key, b"x" * 1000)
    for i, key in enumerate(keys[:3]):
        _age(cache, key, seconds_ago=100 - i)        # 0 the oldest, then 1, then 2
    assert cache.get(keys[0]) == b"x" * 1000         # read now: the most recently used
    cache.put(keys[3], b"x" * 1000)                  # a fourth: one must go, the LRU one
    assert cache.get(keys[1]) is None
    assert all(cache.get(k) == b"x" * 1000 for k in (keys[0], keys[2], keys[3]))
    assert cache.info().size_bytes <= cache.limit_bytes
    cache.put(key_of(n="big"), b"y" * (4 * entry_bytes))   # larger than the limit: not kept
    assert cache.get(key_of(n="big")) is None and cache.info().entries == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "garbage"])
def test_a_damaged_entry_is_a_miss_and_is_removed(tmp_path, damage):
    cache, key = Cache(tmp_path), key_of(n=1)
    cache.put(key, b"a value long enough to cut" * 10)
    (path,) = _files(cache)
    blob = path.read_bytes()
    path.write_bytes({"flip": blob[:-1] + bytes([blob[-1] ^ 1]), "truncate": blob[:-5],
                      "empty": b"", "garbage": b"not a cache file"}[damage])
    assert cache.get(key) is None
    assert not path.exists()
    cache.put(key, b"again")
    assert cache.get(key) == b"again"


def test_clear_removes_every_entry_and_dead_temporary_files_go(tmp_path):
    cache = Cache(tmp_path)
    for i in range(3):
        cache.put(key_of(n=i), b"v")
    folder = _files(cache)[0].parent
    dead, live = folder / ".tmp-dead", folder / ".tmp-live"    # a killed run's, a running one's
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    os.utime(dead, (time.time() - 7200,) * 2)
    cache.put(key_of(n=3), b"v")
    assert not dead.exists() and live.exists()
    assert cache.clear() == 4
    assert cache.info().entries == 0 and cache.get(key_of(n=0)) is None


def test_an_unwritable_folder_warns_once_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = Cache(blocker / "cache")            # its parent is a file: mkdir fails
    with pytest.warns(UserWarning, match="going on without it") as record:
        cache.put(key_of(n=1), b"v")
        cache.put(key_of(n=2), b"v")
    assert len(record) == 1
    assert cache.get(key_of(n=1)) is None and cache.info().entries == 0


def test_the_folder_comes_from_the_environment_the_front_passes(tmp_path):
    home = Path("~").expanduser()
    assert default_folder({}) == home / ".cache" / "memfit"
    assert default_folder({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "memfit"
    assert default_folder({"XDG_CACHE_HOME": "/x", "MEMFIT_CACHE_DIR": str(tmp_path)}) == tmp_path
    with pytest.raises(ValueError, match="limit_bytes"):
        Cache(tmp_path, limit_bytes=-1)


_WRITER = textwrap.dedent("""
    import sys
    from memfit._cache import Cache
    folder, key, fill = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    cache = Cache(folder)
    for _ in range(150):
        cache.put(key, fill * (256 * 1024))
""")


def test_two_processes_writing_one_key_leave_one_whole_entry(tmp_path):
    """Two real processes put different 256 KiB values under one key, 150 times each, while
    this one reads it: every read is one whole value or a miss, and one entry is left."""
    key = key_of(n="shared")
    values = {b"a" * (256 * 1024), b"b" * (256 * 1024)}
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), key, fill])
               for fill in "ab"]
    reader, read = Cache(tmp_path), set()
    while any(w.poll() is None for w in writers):
        value = reader.get(key)
        assert value is None or value in values
        read |= {value} - {None}
    assert [w.returncode for w in writers] == [0, 0]
    assert read == values                       # both writers' values were read as they ran
    assert reader.get(key) in values
    (entry,) = _files(reader)                   # one file: no second copy, no temporary left
    assert entry.name == key


def test_versions_are_read_without_importing_what_they_describe():
    code = ("import sys\nfrom memfit._versions import torch_build, library_version\n"
            "print(torch_build().version, torch_build().cuda, library_version('transformers'),"
            " 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    import torch
    import transformers

    assert out == [torch.__version__, str(torch.version.cuda), transformers.__version__,
                   "False", "False"]
    assert torch_build().cuda == torch.version.cuda
    assert library_version("no-such-distribution-here") is None
