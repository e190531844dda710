"""Bad input is refused in one line naming CLI flags, before any trace (issue 11 items 10, 11,
15); `memfit --help` does not import torch; `gpus` and `models` list the tables."""

import json
import subprocess
import sys
import time
import warnings

import pytest

from memfit.cli import build_parser, main
from memfit.cli._errors import cli_warnings, to_flags


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as e:       # argparse's own refusals
        return e.code


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "--budget", "11"], "11GiB"),                    # a bare 11 is not 11 bytes
    (["estimate", "--budget", "0"], "0 bytes"),
    (["estimate", "--budget", "-3GiB"], "negative"),              # not "expected one argument"
    (["plan", "--budget", "-3GiB"], "negative"),
    (["plan", "--budget=-1"], "negative"),
    (["plan", "--budget", "12 parsecs"], "GiB = 2^30"),
    (["plan", "--reserve", "-1GiB"], "negative"),
    (["plan", "--micro-batch-size", "0"], "at least 1"),
    (["plan", "--max-grad-norm", "-1"], "positive"),
    (["plan", "--progressive", "0.5"], "LEN:FRACTION"),
    (["plan", "--progressive", "128:1.5"], "between 0 and 1"),
    (["estimate", "--image-size", "-4"], "at least 1"),
    (["plan", "--optimizer-impl", "fastest"], "invalid choice"),
])
def test_argument_values_are_refused_by_argparse_with_the_fix(capsys, argv, needle):
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_units_are_explained_in_the_help(capsys):
    assert exit_code(["plan", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GB = 10^9" in out and "GiB = 2^30" in out and "11B" in out


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--plot", "/no/such/folder/p.png"], "does not exist"),
    (["estimate", "--plot", "/no/such/folder/p.png"], "does not exist"),
    (["plan", "--plot", "/"], "that is a folder"),
    (["plan", "--plot", "/tmp/memfit-plot.txt"], ".png"),
    (["plan", "--progressive", "9999"], "at most 512 tokens"),
    (["plan", "--progressive", "9999", "--seq-len", "auto"], "at most 512 tokens"),
    (["plan", "--progressive", "300", "--seq-len", "256"], "below --seq-len 256"),
    (["plan", "--checkpoint", "sometimes"], "--checkpoint sometimes"),
    (["plan", "--reserve", "1GiB", "--budget", "5GiB"], "one of them"),
    (["plan", "--reserve", "12GiB"], "reserve less"),
    (["estimate", "--remat"], "give --budget"),
    (["estimate", "--gpu", "rtx-409"], "memfit gpus"),
    (["estimate", "--model", "bert-bas"], "bert-base"),
    (["estimate", "--task", "image-classification"], "valid tasks"),
    (["estimate", "--config", "/no/such/config.json"], "memfit: error:"),
])
def test_bad_input_is_refused_before_any_trace(capsys, monkeypatch, argv, needle):
    import importlib

    module = importlib.import_module("memfit.api._traced")

    def traced(*args, **kwargs):
        raise AssertionError("a step was traced before the input was checked")

    monkeypatch.setattr(module, "profile_step", traced)   # a trace would fail here
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("memfit: error:") and len(err.splitlines()) == 1


def test_api_names_become_cli_flags():
    assert to_flags("micro_batch_size=4 exceeds batch_size 2") == \
        "--micro-batch-size 4 exceeds --batch-size 2"
    assert to_flags("precision='bf16-pure' halves them") == "--precision bf16-pure halves them"
    assert to_flags("offload_optimizer=True") == "--offload-optimizer on"
    assert to_flags("the checkpoint of each block") == "the checkpoint of each block"
    assert to_flags("memfit.zoo.names() lists them") == "`memfit models` lists them"


def test_the_api_error_reaches_the_cli_in_flags(capsys, tiny_gpt2):
    assert main(["estimate", "--config", tiny_gpt2, "--batch-size", "2", "--seq-len", "16",
                 "--gpu", "cpu", "--checkpoint", "every:0"]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint every:0" in err and "checkpoint=" not in err


def test_warnings_are_shown_once_without_source_lines(capsys):
    with cli_warnings():
        for _ in range(3):
            warnings.warn("budget 12 GiB is more than the card's usable 11 GiB", stacklevel=1)
        warnings.warn("old API", FutureWarning)         # a library's notice to its developers
    err = capsys.readouterr().err
    assert err == "memfit: warning: budget 12 GiB is more than the card's usable 11 GiB\n"


def test_every_subcommand_has_help(capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"plan", "estimate", "gpus", "models"} <= set(sub.choices)
    for name in sub.choices:
        assert exit_code([name, "--help"]) == 0
        assert "usage: memfit " + name in capsys.readouterr().out


def test_help_is_fast_and_imports_no_torch():
    code = ("import sys, io, contextlib\n"
            "from memfit.cli import main\n"
            "for argv in (['--help'], ['plan', '--help'], ['estimate', '--help'],"
            " ['gpus', '--help'], ['models', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try: main(argv)\n"
            "        except SystemExit: pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'transformers', 'numpy', 'matplotlib')))\n")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    assert time.perf_counter() - start < 5     # under a second on an idle machine


@pytest.mark.slow
def test_import_memfit_is_lazy_but_complete():
    code = ("import sys, memfit\n"
            "assert 'torch' not in sys.modules\n"
            "from memfit import plan, estimate, Knobs, Plan, track, remat, OutOfMemory\n"
            "assert all(getattr(memfit, n) is not None for n in memfit.__all__)\n"
            "assert memfit.zoo.get('gpt2').name == 'gpt2'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_gpus_lists_the_table(capsys):
    from memfit.devices import list_devices

    assert main(["gpus", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == [d.name for d in list_devices()]
    assert {r["name"]: r["usable_bytes"] for r in rows}["gtx-1080-ti"] == 11_178 * 2**20
    assert main(["gpus"]) == 0
    assert "gtx-1080-ti" in capsys.readouterr().out


def test_models_lists_the_zoo(capsys):
    from memfit import zoo

    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == zoo.names()
    gpt2 = next(r for r in rows if r["name"] == "gpt2")
    assert gpt2["parameters"] == 124_439_808 and gpt2["default_task"] == "causal-lm"
    assert main(["models"]) == 0
    assert "xlm-roberta-large" in capsys.readouterr().out


def test_optimizer_names_match_the_library():
    from memfit.cli._common import OPTIMIZER_IMPLS, OPTIMIZER_NAMES
    from memfit.optimizers import OPTIMIZERS

    assert OPTIMIZER_NAMES == tuple(sorted(OPTIMIZERS))
    import memfit.knobs as k
    if hasattr(k, "OPTIMIZER_IMPLS"):
        assert OPTIMIZER_IMPLS == k.OPTIMIZER_IMPLS


def test_a_micro_batch_larger_than_the_batch_is_refused(capsys):
    """It would be the whole batch, silently: the estimate and the plan refuse it, naming the
    most it can be (api._validate.check_micro_batch)."""
    for command in ("estimate", "plan"):
        assert main([command, "--model", "gpt2", "--batch-size", "4", "--micro-batch-size", "8",
                     "--seq-len", "16", "--gpu", "cpu"]) == 2
        assert "is larger than the batch (4 samples): give at most 4" in capsys.readouterr().err


def test_a_count_past_any_machine_is_refused_as_it_is_parsed(capsys):
    """A batch of 10^20 samples was a C++ frame dump from torch.randint."""
    assert main(["estimate", "--batch-size", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert "larger than any batch, length or count memfit can build" in err
    assert "Traceback" not in err and "frame #" not in err


def test_an_unknown_flag_points_to_its_subcommands_help(capsys):
    assert main(["estimate", "--no-such-flag"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in err and "`memfit estimate --help`" in err
    assert "usage:" not in err                       # the short form, not the whole usage


def test_seq_len_auto_on_an_image_model_is_refused_at_once(capsys):
    """An image batch has no length to search: it spent 25 s searching before."""
    assert main(["plan", "--model", "vit-base", "--seq-len", "auto", "--gpu", "rtx-4090"]) == 2
    assert "--seq-len auto: vit-base takes images" in capsys.readouterr().err


def test_a_bad_policy_names_block_tuples_as_the_python_apis(capsys):
    """The flags take policies only; the block-name tuple is said to be the Python API's."""
    assert main(["estimate", "--checkpoint", "bogus"]) == 2
    assert "'selective', or, in Python, a tuple of block names" in capsys.readouterr().err
