"""--compile and --activation-memory-budget (issue 30): what is refused before any import of
torch, by flag, with the fix."""

import pytest

from memfit.cli import main


@pytest.mark.parametrize("flags,needle", [
    (["--activation-memory-budget", "0.5"], "needs --compile model or --compile blocks"),
    (["--compile", "model", "--quantize", "nf4", "--lora-rank", "8"],
     "--compile with --quantize nf4 is not modelled"),
])
def test_refused_at_once_with_the_fix(capsys, flags, needle):
    assert main(["estimate", "--model", "llama-1b", "--gpu", "t4", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
