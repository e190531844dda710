import pytest
import torch


# Tiny models on a shared 2-core machine: one intra-op thread is far faster than two fighting
# over the cores (and results do not depend on it).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_gpt2_config(tmp_path_factory):
    """A folder holding a tiny GPT-2 config.json (causal LM), for the CLI's --config."""
    from memfit import zoo

    path = tmp_path_factory.mktemp("tiny-gpt2")
    cfg = zoo.get("gpt2").config(tiny=True)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def _session_cache_folder(tmp_path_factory):
    """memfit's on-disk cache (docs/cache.md) in a folder of this session's, never the user's:
    a test reads only what this run computed, and leaves nothing in ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEMFIT_CACHE_DIR", str(tmp_path_factory.mktemp("memfit-cache")))
        mp.delenv("MEMFIT_CACHE_LIMIT", raising=False)
        yield


@pytest.fixture(autouse=True)
def _fresh_bnb_overrides():
    """bitsandbytes keeps per-parameter overrides in a process-wide manager, keyed by ``id`` and
    by position, never cleared: a Trainer with ``optim="adamw_bnb_8bit"`` leaves its embedding's
    ``optim_bits=32`` at (0, 0) for every later bitsandbytes optimizer in the process. Each test
    starts from the empty manager a fresh process has (memfit's own optimizers hold their own
    manager: _bnb_optimizer Note 2)."""
    yield
    import sys
    mod = sys.modules.get("bitsandbytes.optim.optimizer")
    if mod is not None and mod.GlobalOptimManager._instance is not None:
        mod.GlobalOptimManager._instance.initialize()


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


# Opt-in leak report (MEMFIT_TEST_LEAKS=FILE): after each test, the bytes of CPU storages that
# Python can still reach; each test after which they grew is written to FILE. remat's budget
# counts every byte in the process (its Note 8), so a test that leaves tensors reachable (a
# runner left open, a cache) shows up here rather than as a remat failure far later.
_LEAKS = __import__("os").environ.get("MEMFIT_TEST_LEAKS")
_reachable = [0]


def _reachable_cpu_bytes() -> int:
    """Bytes of the real CPU storages behind reachable tensors: a wrapper subclass's inner ones
    (a DTensor's local shard), none of a fake's (meta storages)."""
    import gc

    from memfit.measure._ledger import storages_of
    gc.collect()
    seen, total = set(), 0
    for t in gc.get_objects():
        if not isinstance(t, torch.Tensor):
            continue
        for st in storages_of(t, "cpu"):
            if st.device.type != "meta" and st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
    return total


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _LEAKS:
        now = _reachable_cpu_bytes()
        if now > _reachable[0]:
            with open(_LEAKS, "a") as f:
                f.write(f"{now - _reachable[0]:>12} {now:>12} {item.nodeid}\n")
        _reachable[0] = now
