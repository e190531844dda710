"""Lifetime classes and the modelled allocator settings (``memplan._pools``)."""

import numpy as np
import pytest

from memfit.memplan import LIFETIME_CLASSES, allocator_options, lifetime_class
from memfit.memplan._pools import _pool_keys


def test_classes_partition_the_step(gpt2_gpu):
    opts = allocator_options(gpt2_gpu)
    life = gpt2_gpu.lifetimes.window()
    assert list(opts.classes) == list(LIFETIME_CLASSES)
    assert sum(c["storages"] for c in opts.classes.values()) == len(life)
    assert sum(c["bytes"] for c in opts.classes.values()) == int(life.nbytes.sum())
    # the run class is alive throughout: its peak is all of it (parameters, optimizer state)
    assert opts.classes["run"]["peak_live_bytes"] == opts.classes["run"]["bytes"]
    assert lifetime_class("activations") == "saved" and lifetime_class("grads") == "step"


def test_every_option_reserves_at_least_what_it_allocates(gpt2_gpu):
    opts = allocator_options(gpt2_gpu)
    assert len(opts.options) == 8 and opts.default.name == "default"
    for o in opts.options:
        assert o.reserved_bytes >= o.allocated_bytes > 0
    assert opts.best.applicable and opts.saved_bytes >= 0
    assert opts.best.reserved_bytes == min(o.reserved_bytes for o in opts.options if o.applicable)
    # routing changes where blocks live, never which blocks: every scheme allocates the same
    # blocks, so its allocated peak is the default's (frees are immediate, allocator Note 5)
    assert {o.allocated_bytes for o in opts.options} == {opts.default.allocated_bytes}


def test_phase_routing_sends_optimizer_state_to_the_optimizer_pool(gpt2_gpu):
    log = gpt2_gpu.lifetimes
    keys = np.array(_pool_keys(log, "phase-pools", gpt2_gpu.phases))
    cats = log.category
    from memfit.measure._ledger import OPTIMIZER, PARAMS
    assert set(keys[cats == OPTIMIZER]) == {"optimizer"}
    assert set(keys[cats == PARAMS]) == {"default"}
    assert {"forward", "optimizer", "default"} == set(keys)


def test_unknown_scheme_is_refused(gpt2_gpu):
    with pytest.raises(ValueError, match="schemes must include 'default'"):
        allocator_options(gpt2_gpu, schemes=("default", "by-tensor"))
