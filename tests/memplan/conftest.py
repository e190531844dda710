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
