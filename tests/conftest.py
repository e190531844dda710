import pytest
import torch


# Tiny models on a shared 2-core machine: one intra-op thread is far faster than two fighting
# over the cores (and results do not depend on it).
torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run slow tests")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "requires_gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
