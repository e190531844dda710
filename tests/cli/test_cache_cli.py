"""`memfit models` counts each model once and reads the count from memfit's cache after that;
`memfit gpus`, `memfit models` (warm) and the refusals that need no trace answer without
importing torch or transformers (what kept them seconds long: issue 29); `memfit cache`.

The zoo is cut to two models here (``memfit._zoo_table.ROWS``, which `memfit models` lists) so
a cold listing builds two models, not all of them; the counts are checked against torch's own
count of the model built on the meta device."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from memfit.cli import main

_TWO = ("gpt2", "bert-base")


@pytest.fixture
def two_models(monkeypatch, tmp_path):
    """The zoo's table cut to two models, and a cache folder of the test's own. The zoo and its
    index of names are built from the whole table first (at their import), so only the listing,
    which reads the table each time, sees two."""
    from memfit import _zoo_names, _zoo_table, zoo  # noqa: F401  (imported before the cut)

    monkeypatch.setattr(_zoo_table, "ROWS", tuple(r for r in _zoo_table.ROWS if r.name in _TWO))
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path))
    return tmp_path


def _listed(capsys, *flags) -> dict[str, int]:
    assert main(["models", "--json", *flags]) == 0
    return {r["name"]: r["parameters"] for r in json.loads(capsys.readouterr().out)}


def _no_build(monkeypatch):
    from memfit.zoo import ModelSpec

    def build(*args, **kwargs):
        raise RuntimeError("a model was built")

    monkeypatch.setattr(ModelSpec, "build", build)


def test_models_counts_once_then_reads_the_cache(two_models, monkeypatch, capsys):
    from memfit import zoo

    first = _listed(capsys)
    gpt2 = zoo.get("gpt2").build(device="meta")
    assert first["gpt2"] == sum(p.numel() for p in gpt2.parameters()) == 124_439_808
    assert set(first) == set(_TWO)
    assert main(["cache", "info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 2
    _no_build(monkeypatch)                      # from here a model built is an error
    assert _listed(capsys) == first             # read from the cache
    with pytest.raises(RuntimeError, match="a model was built"):
        _listed(capsys, "--no-cache")           # neither read nor ...


def test_no_cache_writes_nothing_and_a_damaged_entry_is_counted_again(two_models, capsys):
    counted = _listed(capsys, "--no-cache")
    assert not any(p.is_file() for p in two_models.rglob("*"))      # ... written
    assert _listed(capsys) == counted
    for entry in (p for p in two_models.rglob("*") if p.is_file()):
        entry.write_bytes(entry.read_bytes()[:-1])                   # cut short
    assert _listed(capsys) == counted
    assert main(["cache", "clear", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["removed"], out["entries"], out["folder"]) == (2, 0, str(two_models))


def test_a_bad_cache_limit_is_refused_with_the_fix(two_models, monkeypatch, capsys):
    monkeypatch.setenv("MEMFIT_CACHE_LIMIT", "lots")
    assert main(["cache"]) == 2
    assert "MEMFIT_CACHE_LIMIT=lots" in capsys.readouterr().err


_WITHOUT_TORCH = textwrap.dedent("""
    import contextlib, io, json, sys
    from memfit import _zoo_table
    from memfit import _zoo_names               # its index of names: the whole table
    _zoo_table.ROWS = tuple(r for r in _zoo_table.ROWS if r.name in {two!r})
    from memfit.cli import main
    codes, out = [], io.StringIO()
    for argv in {commands!r}:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            codes.append(main(argv))
    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))
    print(json.dumps({{"codes": codes, "heavy": heavy}}))
""")


def test_listings_and_refusals_import_no_torch(two_models, capsys, tmp_path):
    """Each of these answered in seconds because it imported torch and transformers first
    (`memfit estimate --model nope`: 5.5 s); none of them needs to."""
    _listed(capsys)                             # the two counts, cached for the subprocess
    refusals = [["estimate", "--model", "nope"], ["plan", "--gpu", "1080"],
                ["estimate", "--config", str(tmp_path / "missing" / "config.json")],
                ["estimate", "--checkpoint", "bogus"], ["plan", "--model", "gpt2", "--task", "x"],
                ["estimate", "--model", "gpt2", "--revision", "main"],
                ["plan", "--budget", "3"], ["estimate", "--batch-size", "0"],
                ["bench", "seed", "--gpu", "nope"],
                ["estimate", "--offload-params", "all"],        # knob conflicts (Knobs.
                ["plan", "--offload-gradients"]]                # check_combinations)
    commands = [["gpus", "--json"], ["models", "--json"], ["cache", "--json"], *refusals]
    code = _WITHOUT_TORCH.format(two=_TWO, commands=commands)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0, 0, 0] + [2] * len(refusals)
    assert result["heavy"] == []
