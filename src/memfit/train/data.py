"""Reading a CSV / JSONL training file with Hugging Face ``datasets``, and checking it first.

Note 1 (checked before anything is built). Every problem a file can have is found here, before a
model, a tokenizer or a plan is made, and named with the fix: a missing or empty file, an
unknown format, a column that is not there (the columns that are, listed), a text column that
holds no text, empty text or a missing value (the row, counted from 1 as a spreadsheet shows
it), labels that are not 0/1 or class ids 0..K-1. Nothing is written, so nothing is lost.

Note 2 (labels). ``toxic`` in the Jigsaw files is 0/1; a multi-class file has ids 0..K-1.
Booleans and whole floats (1.0) are taken as ids; strings, fractions (0.3: a score, not a
class) and ids with gaps (1, 2 without 0) are refused, since a silent mapping would train on
labels the user did not mean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from memfit.train._deps import require

__all__ = ["Table", "load_table", "split_holdout"]

_FORMATS = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json"}


@dataclass(frozen=True)
class Table:
    """The texts and labels of one file (Note 1)."""

    texts: list[str]
    labels: list[int]
    num_labels: int          # K: labels are 0..K-1 (2 for 0/1)
    path: str


def _read(path: str, flag: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: that is a folder; give a .csv or .jsonl file")
    fmt = _FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise ValueError(f"{flag} {path}: the file name must end in .csv, .tsv, .jsonl or .json "
                         "(the format is taken from it)")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{flag} {path}: the file is empty; it needs a header row and at least "
                         "one row of data")
    if fmt == "csv" and _lines(path) < 2:
        raise ValueError(f"{flag} {path}: the file has a header but no rows of data")
    datasets = require("datasets")
    datasets.disable_progress_bars()
    try:
        if fmt == "csv":
            sep = "\t" if path.lower().endswith(".tsv") else ","
            return datasets.Dataset.from_csv(path, sep=sep, keep_in_memory=True)
        return datasets.Dataset.from_json(path, keep_in_memory=True)
    except Exception as e:   # pandas / pyarrow parse errors have many types: name the file
        if isinstance(e, (ValueError, OSError)) and str(path) in str(e):
            raise
        raise ValueError(f"{flag} {path}: cannot be read as {fmt.upper()}: "
                         f"{type(e).__name__}: {str(e).strip()[:300]}") from e


def _lines(path: str, enough: int = 2) -> int:
    """Non-blank lines, counted up to ``enough``."""
    n = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            n += bool(line.strip())
            if n >= enough:
                break
    return n


def load_table(path, text_column: str, label_column: str, *, flag: str = "--data",
               num_labels: int | None = None) -> Table:
    """The file's texts and labels, checked (Notes 1-2). ``num_labels``: the K the model was
    made for (an eval file must not hold a class the training file did not)."""
    path = str(path)
    ds = _read(path, flag)
    if ds.num_rows == 0:
        raise ValueError(f"{flag} {path}: the file has a header but no rows of data")
    columns = list(ds.column_names)
    for what, name in (("--text-column", text_column), ("--label-column", label_column)):
        if name not in columns:
            raise ValueError(f"{what} {name!r}: {path} has no such column; its columns are "
                             f"{', '.join(map(repr, columns))}")
    texts = _texts(ds[text_column], text_column, path, columns)
    labels, k = _labels(ds[label_column], label_column, path)
    if num_labels is not None and k > num_labels:
        raise ValueError(f"{flag} {path}: label {k - 1} in {label_column!r}, but the model was "
                         f"made for {num_labels} classes (0..{num_labels - 1}) from the "
                         "training data")
    return Table(texts, labels, max(k, num_labels or 2), path)


def _texts(values, name: str, path: str, columns: list[str]) -> list[str]:
    out = []
    for row, v in enumerate(values, start=2):     # row 1 is the header
        if v is None:
            raise ValueError(f"--text-column {name!r}: row {row} of {path} has no text (an "
                             "empty cell); fill it in or drop the row")
        if not isinstance(v, str):
            return _not_text(name, v, path, columns, values)
        if not v.strip():
            raise ValueError(f"--text-column {name!r}: row {row} of {path} is blank; fill it "
                             "in or drop the row")
        out.append(v)
    return out


def _not_text(name, value, path, columns, values):
    kind = "numbers" if isinstance(value, (int, float)) else type(value).__name__ + " values"
    raise ValueError(f"--text-column {name!r} holds {kind} ({value!r}), not text: name the "
                     f"column with the comments (the columns of {path} are "
                     f"{', '.join(map(repr, columns))})")


def _labels(values, name: str, path: str) -> tuple[list[int], int]:
    out = []
    for row, v in enumerate(values, start=2):
        if v is None:
            raise ValueError(f"--label-column {name!r}: row {row} of {path} has no label; "
                             "labels must be 0/1 or class ids 0..K-1")
        if isinstance(v, bool):
            v = int(v)
        elif isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or v < 0:
            hint = " (a score: threshold it, e.g. toxic = score >= 0.5)" \
                if isinstance(v, float) else ""
            raise ValueError(f"--label-column {name!r}: row {row} of {path} has label {v!r}"
                             f"{hint}; labels must be 0/1 or class ids 0..K-1")
        out.append(v)
    seen = sorted(set(out))
    k = seen[-1] + 1
    if len(seen) < 2:
        raise ValueError(f"--label-column {name!r}: every row of {path} has label {seen[0]}; "
                         "a classifier needs at least two classes")
    if len(seen) != k:
        missing = sorted(set(range(k)) - set(seen))
        raise ValueError(f"--label-column {name!r}: the labels of {path} are "
                         f"{', '.join(map(str, seen[:10]))}; labels must be 0/1 or class ids "
                         f"0..K-1 with none missing (no row has "
                         f"{', '.join(map(str, missing[:10]))}): renumber them")
    return out, k


def split_holdout(table: Table, fraction: float, seed: int) -> tuple[Table, Table]:
    """(train, held-out) rows: ``fraction`` of them drawn with ``seed``, at least one each."""
    import numpy as np

    n = len(table.labels)
    k = max(1, round(n * fraction))
    if n < 2 or k >= n:
        raise ValueError(f"{table.path} has {n} rows: too few to hold out {fraction:g} of them "
                         "for evaluation; give --eval-data FILE or more rows")
    order = np.random.default_rng(seed).permutation(n)
    held, kept = sorted(order[:k].tolist()), sorted(order[k:].tolist())

    def take(idx):
        return Table([table.texts[i] for i in idx], [table.labels[i] for i in idx],
                     table.num_labels, table.path)
    return take(kept), take(held)
