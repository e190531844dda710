"""Numbered notes in ``src/memfit``: numbered in order within a file, cited only within it.

A module's docstring writes its hard mechanisms down as numbered notes, each a paragraph that
opens "Note N (title)." (or "Note N." / "Note N:"); its code and docstrings cite them as
"(Note N)", "Notes 1-3", "Notes 2 and 5". Knowledge that another file needs is stated where it
is needed, or written in docs/ and pointed to there: a citation of another module's note ("see
``planner.sharding`` Note 2", "Note 2 of ``trace.fake``") sends the reader to a number that
moves whenever that file's notes do (issue 27).

The test reads every ``src/memfit/**/*.py`` as text; a definition is a paragraph of the module
docstring that opens with "Note N" (its docstring is found with ``ast``). Every other "Note"
or "Notes" in the file, in a docstring, a comment or a string, is a citation."""

import ast
import bisect
import pathlib
import re

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "memfit"
ROOT = SRC.parents[1]

# "Note 3 (title)." / "Note 3." / "Note 3:" at the start of a paragraph of the module docstring
DEFINITION = re.compile(r"""^\s*(?:[rRuUbB]{0,2}(?:\"\"\"|'''))?(Note (\d+))\s*[(.:]""")
# "Note 3", "Notes 1-4", "Notes 4–5", "Notes 1, 2 and 5", "Note" or "Notes" with no number
NUMBERS = r"\d+(?:\s*(?:[-–]|,|\band\b|\bor\b)\s*\d+)*"
CITATION = re.compile(rf"\bNotes?\b(?:\s+({NUMBERS}))?")
# the word just before a citation: "``planner.sharding`` Note 2", "(devices Note 4",
# "``api.plan``'s Note 3", "see memory_model.py Note"; "(its Note 1)", "whose Note 2"
# name another's too
BEFORE = re.compile(r"(?:^|[\s(\[{,;:])(`{0,2})([A-Za-z_][\w./]*[\w])(`{0,2})(?:'s)?\s+$")
# a name just after one: "Note 2 of ``trace.data_dependent``", "The Notes are in ``x``"
AFTER = re.compile(r"\s+(?:of|(?:are|is)\s+in)\s+(`{0,2})([A-Za-z_][\w./]*[\w])(`{0,2})")


def _module_name(path: pathlib.Path) -> str:
    parts = ("memfit",) + path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def _files() -> list[pathlib.Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def _known_names() -> set[str]:
    """Every module's and package's last name, with and without its leading underscore."""
    names = {"memfit"}
    for path in _files():
        for part in _module_name(path).split("."):
            names |= {part, part.lstrip("_")}
    return names


def _own_names(path: pathlib.Path) -> set[str]:
    """The ways a file names itself: ``plan``, ``api.plan``, ``memfit.api.plan``, ``plan.py``."""
    parts = _module_name(path).split(".")
    own = {".".join(parts[i:]) for i in range(len(parts))}
    own |= {name.lstrip("_") for name in own} | {parts[-1] + ".py", parts[-1].lstrip("_") + ".py"}
    return own | {str(path.relative_to(SRC)), str(path.relative_to(ROOT))}


def _is_module(ticks: str, name: str, known: set[str]) -> bool:
    """Whether a word names a module: in backticks, dotted, a file, with an underscore, or a
    module's name (``devices``, ``search``)."""
    return bool(ticks) or "." in name or "_" in name or name in known


def _numbers(text: str) -> list[int]:
    """``"1-4, 6"`` -> [1, 2, 3, 4, 6]."""
    out = []
    for piece in re.split(r",|\band\b|\bor\b", text):
        ends = [int(n) for n in re.findall(r"\d+", piece)]
        out += list(range(ends[0], ends[-1] + 1)) if len(ends) == 2 else ends
    return out


def _definitions(path: pathlib.Path, lines: list[str]) -> list[tuple[int, int]]:
    """(note number, line) of each note the module docstring defines, in order."""
    tree = ast.parse("\n".join(lines))
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return []
    out = []
    for line in range(first.lineno, first.end_lineno + 1):
        text = lines[line - 1]
        starts_paragraph = line == first.lineno or not lines[line - 2].strip()
        match = DEFINITION.match(text)
        if match and starts_paragraph:
            out.append((int(match.group(2)), line))
    return out


def _violations() -> tuple[list[str], list[str]]:
    """(numbering, citation) violations, each ``path:line: what``."""
    known = _known_names()
    numbering, citations = [], []
    for path in _files():
        text = path.read_text()
        lines = text.splitlines()
        where = str(path.relative_to(ROOT))
        defs = _definitions(path, lines)
        for i, (number, line) in enumerate(defs, start=1):
            if number != i:
                numbering.append(f"{where}:{line}: Note {number} is the file's note {i} "
                                 f"(notes must be numbered 1..{len(defs)} in order)")
        defined = {n for n, _ in defs}
        def_lines = {line for _, line in defs}
        own = _own_names(path)
        starts = [0] + [m.end() for m in re.finditer("\n", text)]
        for match in CITATION.finditer(text):
            line = bisect.bisect_right(starts, match.start())
            head = lines[line - 1]
            if line in def_lines and not head[:match.start() - starts[line - 1]].strip(" \"'rRuUbB"):
                continue
            quote = " ".join(text[match.start():match.end() + 30].split())
            named = []
            before = BEFORE.search(text[max(0, match.start() - 120):match.start()])
            if before and _is_module(before.group(1), before.group(2), known):
                named.append(before.group(2))
            after = AFTER.match(text, match.end())
            if after and _is_module(after.group(1), after.group(2), known):
                named.append(after.group(2))
            if re.search(r"\b(its|whose|their) $", text[max(0, match.start() - 6):match.start()]):
                named.append("another module")   # "(its Note 1)": a note of what the text names
            others = [n for n in named if n.removesuffix(".py") not in own and n not in own]
            if others:
                citations.append(f"{where}:{line}: cites {others[0]}'s note: {quote!r}")
                continue
            if match.group(1) is None:
                if not defined:
                    citations.append(f"{where}:{line}: points to notes the file does not "
                                     f"have: {quote!r}")
                continue
            missing = [n for n in _numbers(match.group(1)) if n not in defined]
            if missing:
                citations.append(f"{where}:{line}: Note {missing[0]} is not defined in this "
                                 f"file (it defines {sorted(defined) or 'none'}): {quote!r}")
    return numbering, citations


def test_notes_are_numbered_in_order():
    numbering, _ = _violations()
    assert not numbering, f"{len(numbering)} notes out of order:\n" + "\n".join(numbering)


def test_notes_are_cited_only_within_their_file():
    _, citations = _violations()
    assert not citations, (f"{len(citations)} citations of a note not in the citing file "
                           "(state the point in place, or point to docs/):\n"
                           + "\n".join(citations))
