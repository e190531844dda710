"""Traced steps shared by the memplan tests (each estimate costs a few seconds)."""

import pytest

import memfit
from memfit import zoo


def tiny_estimate(name="gpt2", device="cpu", batch_size=2, seq_len=16, **kw):
    spec = zoo.get(name)
    model = spec.build(tiny=True, device="meta")
    text = spec.family != "vision"
    batch = spec.make_batch(model, batch_size, seq_len=seq_len if text else None)
    return memfit.estimate(model, batch, optimizer="adamw", device=device, **kw)


@pytest.fixture(scope="session")
def gpt2_cpu():
    return tiny_estimate("gpt2", "cpu")


@pytest.fixture(scope="session")
def gpt2_gpu():
    return tiny_estimate("gpt2", "a100-80gb")


@pytest.fixture(scope="session")
def tiny_gpt2_config(tmp_path_factory):
    """A folder holding a tiny GPT-2 config.json, for the CLI's --config."""
    path = tmp_path_factory.mktemp("tiny-gpt2")
    cfg = zoo.get("gpt2").config(tiny=True)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(path)
    return str(path)
