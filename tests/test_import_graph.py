"""The import graph of ``src/memfit``: no cycle, and no layer imports one above it (issue 27).

Every import is read with ``ast``, those inside functions too (an import deferred into a
function to dodge a cycle is still a cycle); imports under ``if TYPE_CHECKING:`` never run and
are not edges, nor is a module's import of its own parent package."""

import ast
import pathlib

import networkx as nx
import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "memfit"

# the core's layers, lowest first; each may import only those before it (and the leaf modules
# at the top of the package: units, devices, knobs, errors, step, optimizers...)
LAYERS = ["measure", "trace", "memplan", "techniques", "planner", "runtime", "api"]
ABOVE_CORE = ["integrations", "report", "cli", "train", "studies"]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ("memfit",) + path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


def _running(tree: ast.AST):
    """The nodes of ``tree`` that run: those under ``if TYPE_CHECKING:`` left out."""
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test)
                   for sub in node.body for n in ast.walk(sub)}
    return (node for node in ast.walk(tree) if id(node) not in typing_only)


def _graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in _running(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != name and not name.startswith(t + "."):
                    g.add_edge(name, t)
    return g


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS + ABOVE_CORE) \
        else None


def test_no_import_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert cycles == []


@pytest.mark.parametrize("layer", LAYERS)
def test_a_core_layer_imports_no_layer_above_it(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1:] + ABOVE_CORE)
    upward = sorted((a, b) for a, b in _graph().edges
                    if _layer(a) == layer and _layer(b) in above)
    assert upward == []


def _function_imports(path: pathlib.Path) -> list[str]:
    """memfit imports made inside a function of ``path`` (not under ``TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in _running(fn):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level \
                else ["."] if isinstance(node, ast.ImportFrom) else []
            out += [f"{path.relative_to(SRC)}:{node.lineno} {n}" for n in names
                    if n == "." or n == "memfit" or n.startswith("memfit.")]
    return out


def test_no_memfit_import_inside_a_function_below_the_cli():
    """Imports sit at the top of a module (an import deferred into a function hides a cycle);
    the CLI and the applications (``cli``, ``train``) defer theirs so that ``memfit --help``
    starts without torch: the only exception."""
    deferred = [hit for path in sorted(SRC.rglob("*.py"))
                if path.relative_to(SRC).parts[0] not in ("cli", "train")
                for hit in _function_imports(path)]
    assert deferred == []
