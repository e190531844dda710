"""bitsandbytes is imported with its torch.compile wrappers made lazy (_bnb_optimizer Note 4)."""

import subprocess
import sys

import torch

from memfit.techniques._bnb_optimizer import _compile_on_first_call


def test_a_wrapped_function_compiles_at_its_first_call_with_the_same_arguments(monkeypatch):
    calls = []
    real = torch.compile

    def counting(model=None, **kwargs):
        calls.append(kwargs)
        return real(model, **kwargs)

    monkeypatch.setattr(torch, "compile", counting)
    with _compile_on_first_call():
        f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)

        @torch.compile(backend="eager")
        def g(x):
            return x - 1
    assert torch.compile is counting                 # put back as it was
    assert calls == []                               # nothing compiled at import
    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 2 + 1) and torch.equal(f(x), x * 2 + 1)
    assert torch.equal(g(x), x - 1)
    assert calls == [{"backend": "eager", "dynamic": False}, {"backend": "eager"}]  # once each


def test_importing_bitsandbytes_does_not_import_inductor():
    code = ("import sys, torch\n"
            "from memfit.techniques._bnb_optimizer import import_bitsandbytes\n"
            "real = torch.compile\n"
            "import_bitsandbytes()\n"
            "import bitsandbytes.optim\n"
            "assert torch.compile is real\n"
            "print('torch._inductor.compile_fx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
