"""A repeated ``memfit estimate`` / ``memfit plan`` prints its kept answer without importing
torch (issue 29: a warm command in under a second; ``memfit.cli._replay``).

The oracle is the first run's own stdout: the second, in a fresh interpreter, prints the same
bytes, and torch and transformers are never imported there. A changed input is another key,
and a command that writes a file runs every time."""

import json
import subprocess
import sys
import textwrap

from memfit import zoo
from memfit.cli import main

_AGAIN = textwrap.dedent("""
    import contextlib, io, json, sys
    from memfit.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main({argv!r})
    heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))
    print(json.dumps({{"code": code, "out": out.getvalue(), "heavy": heavy}}))
""")


def _again(argv, env):
    run = subprocess.run([sys.executable, "-c", _AGAIN.format(argv=argv)], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_repeated_command_prints_its_answer_without_torch(tmp_path, monkeypatch, capsys):
    import os

    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    config = zoo.get("gpt2").config(tiny=True)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path / "model")
    argv = ["estimate", "--config", str(tmp_path / "model"), "--batch-size", "2",
            "--seq-len", "16", "--gpu", "t4", "--json"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    again = _again(argv, dict(os.environ))
    assert again == {"code": 0, "out": first, "heavy": []}
    # a changed config file is another key: traced again, its own answer
    config.n_layer += 1
    config.save_pretrained(tmp_path / "model")
    assert main(argv) == 0
    changed = capsys.readouterr().out
    assert json.loads(changed)["peak_bytes"] != json.loads(first)["peak_bytes"]
    # a command that writes a file runs every time: the same answer, and its plot again
    plot = tmp_path / "step.png"
    assert main(argv[:-1] + ["--plot", str(plot)]) == 0 and plot.is_file()
