"""The versions of memfit and of the libraries it models, read without importing them.

Note 1 (torch's build without torch). Importing torch takes seconds, and listing the GPU
table, or refusing a GPU name, needs only the CUDA the installed torch was built for. torch
writes that, with its version, into ``torch/version.py`` when it is built (what
``torch.version.cuda`` and ``torch.__version__`` hold once torch is imported).
``torch_build`` reads those two assignments from the file as literals (``ast``), executing
nothing; ``importlib.util.find_spec("torch")`` finds the file without importing torch.

Note 2 (memfit's code version). ``memfit.__version__`` changes at a release, the code at
every edit: a cached result keyed by the version alone would outlive the code that computed
it in a checkout. ``code_version()`` is the version and a digest of every ``.py`` file of the
package (its path and bytes; a few milliseconds), so an edit anywhere gives new cache keys.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from memfit import __version__

__all__ = ["TorchBuild", "torch_build", "library_version", "code_version", "TRACED_LIBRARIES"]

# the libraries a trace runs through, beside torch: a cached figure is keyed by their versions
TRACED_LIBRARIES = ("transformers", "peft", "bitsandbytes", "torchao", "accelerate")


@dataclass(frozen=True)
class TorchBuild:
    """What the installed torch says of itself (Note 1)."""

    version: str            # torch.__version__, e.g. "2.13.0+cpu"
    cuda: str | None        # torch.version.cuda, e.g. "12.8"; None for a CPU-only build


@functools.cache
def torch_build() -> TorchBuild:
    """The installed torch's version and CUDA, read from ``torch/version.py`` (Note 1)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("memfit needs torch: pip install torch")
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    values = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target = node.target
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("__version__", "cuda"):
            values[target.id] = ast.literal_eval(node.value)
    if "__version__" not in values:
        raise ImportError(f"{path} does not set __version__ as torch's builds do: reinstall "
                          "torch")
    return TorchBuild(values["__version__"], values.get("cuda"))


@functools.cache
def library_version(name: str) -> str | None:
    """The installed version of the distribution ``name`` ("transformers"), None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def code_version() -> str:
    """memfit's version and a digest of its source files (Note 2), e.g. "0.1.0+3f9a0c2e1b7d4a65"."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"{__version__}+{digest.hexdigest()[:16]}"
