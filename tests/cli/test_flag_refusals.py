"""Refusals the flags alone decide come before torch is imported (cli._common.check_flags):
they took 10-37 s (a model built, a trace begun) before; each is one line with the fix."""

import subprocess
import sys

import pytest

from memfit.cli import main

CASES = [
    (["--lora-targets", "q_proj"], "give --lora-rank R too"),
    (["--lora-rank", "8", "--lora-targets", ","], "give module names"),
    (["--quantize", "nf4"], "add --lora-rank R (QLoRA) or --freeze PATTERN"),
    (["--optimizer", "sgd", "--optimizer-state", "8bit"], "give --optimizer adamw"),
    (["--packing", "--padded"], "give --packing or --padded, not both"),
    (["--attn-implementation", "flash_attention_2"], "runs in fp16 or bf16 only"),
]


@pytest.mark.parametrize("command", ["estimate", "plan"])
@pytest.mark.parametrize("flags,needle", CASES)
def test_refused_in_one_line(capsys, command, flags, needle):
    assert main([command, "--model", "llama-1b", "--gpu", "t4", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_refused_before_torch_is_imported():
    code = ("import sys; from memfit.cli import main; "
            "codes = [main(['plan', '--model', 'llama-1b', *f]) for f in %r]; "
            "print(codes, 'torch' in sys.modules)" % [f for f, _ in CASES])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120).stdout
    assert out.strip() == f"{[2] * len(CASES)} False"


def test_the_low_bit_names_are_the_classes():
    from memfit.cli._flag_checks import _LOW_BIT_NAMES
    from memfit.techniques.low_bit_optimizer import LOW_BIT_CLASSES

    assert _LOW_BIT_NAMES == tuple(k.lower() for k in LOW_BIT_CLASSES)
