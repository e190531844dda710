"""A subcommand's answer kept whole, and printed again without importing torch.

``memfit estimate`` and ``memfit plan`` spend about 10 s importing torch and transformers on
a 2-core machine before they trace anything; their traces are cached
(``memfit.api._trace_cache``), but a repeated command still pays the imports. So the text a
successful run printed on stdout is kept in memfit's cache under a key of everything that
decides it, and the same command prints it back at once (docs/cache.md).

Note 1 (the key). The command line as parsed; memfit's code digest and the versions of torch
and the libraries it traces through (``memfit._versions``, read without importing them); the
bytes of the files the command reads (``--config``, ``--device``); the ``MEMFIT_*`` and
``PYTORCH_CUDA_ALLOC_CONF`` settings; and how stdout is drawn (a terminal or not, its width,
``COLUMNS``): rich wraps and colours by them. A command that reads what the key cannot name
(a hub model, a ``--hf-args`` file) or writes files (``--plot``, ``--report``,
``--snapshot``, ``--static-plan-plot``, ``--export``) runs every time; so does one that
failed.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
from pathlib import Path

from memfit._cache import key_of
from memfit._versions import TRACED_LIBRARIES, code_version, library_version, torch_build
from memfit._zoo_names import names as zoo_names

__all__ = ["run_replayable"]

_COMMANDS = ("estimate", "plan")
_WRITES = ("plot", "report", "snapshot", "static_plan_plot", "export", "hf_args")


def run_replayable(args, argv: list[str], cache, run) -> int:
    """``run()``'s exit code; its stdout printed back from ``cache`` where the same command
    succeeded before, else kept there after it succeeds (Note 1)."""
    key = _key(args, argv) if cache is not None else None
    if key is None:
        return run()
    kept = cache.get(key)
    if kept is not None:
        sys.stdout.write(kept.decode())
        sys.stdout.flush()
        return 0
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        code = run()
    finally:
        sys.stdout = tee.target
    if code == 0:
        cache.put(key, tee.text.getvalue().encode())
    return code


def _key(args, argv: list[str]) -> str | None:
    if getattr(args, "command", None) not in _COMMANDS or any(getattr(args, n, None)
                                                               for n in _WRITES):
        return None
    model = getattr(args, "model", None)
    if model is not None and model not in zoo_names():
        return None                                     # a hub model: its config may change
    files = {}
    for name in ("config", "device"):
        value = getattr(args, name, None)
        if value is None:
            continue
        path = Path(value)
        path = path / "config.json" if path.is_dir() else path
        try:
            files[name] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return None
    out = sys.stdout
    tty = bool(getattr(out, "isatty", lambda: False)())
    build = torch_build()
    return key_of(figure="cli-answer", argv=list(argv), files=files, code=code_version(),
                  torch=[build.version, build.cuda],
                  libraries={n: library_version(n) for n in TRACED_LIBRARIES},
                  environ={k: v for k, v in sorted(os.environ.items())
                           if (k.startswith("MEMFIT_") and not k.startswith("MEMFIT_CACHE"))
                           or k in ("PYTORCH_CUDA_ALLOC_CONF", "COLUMNS", "NO_COLOR",
                                    "FORCE_COLOR", "TERM")},
                  terminal=[tty, list(shutil.get_terminal_size()) if tty else None])


class _Tee(io.TextIOBase):
    """stdout as it was, and a copy of what is written to it."""

    def __init__(self, target):
        self.target = target
        self.text = io.StringIO()

    def write(self, s: str) -> int:
        self.text.write(s)
        return self.target.write(s)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self):
        return getattr(self.target, "encoding", "utf-8")
