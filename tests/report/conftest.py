"""A tiny GPT-2 traced with its record kept (``report._capture``), shared by the report tests."""

import pytest

import memfit
from memfit import zoo
from memfit.report._capture import traced


def traced_estimate(model, batch, **kwargs):
    """``memfit.estimate(model, batch, **kwargs)`` and its trace's tracker."""
    with traced(model) as cap:
        est = memfit.estimate(model, batch, **kwargs)
    return est, cap.take()


@pytest.fixture(scope="session")
def tiny_step():
    spec = zoo.get("gpt2")
    model = spec.build(tiny=True)
    return model, spec.make_batch(model, 4, seq_len=32)


@pytest.fixture(scope="session")
def gpu_step(tiny_step):
    """Two micro-batches on a GTX 1080 Ti (the caching-allocator model), under a budget."""
    model, batch = tiny_step
    return traced_estimate(model, batch, device="gtx-1080-ti", micro_batch_size=2,
                           budget="30MiB")


@pytest.fixture(scope="session")
def cpu_step(tiny_step):
    model, batch = tiny_step
    return traced_estimate(model, batch, device="cpu", micro_batch_size=2)
