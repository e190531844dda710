"""``memfit.runtime.mem_pools`` on a machine without CUDA: its refusals and its no-ops.

What it does on a GPU (the pools entered, the allocator config read) cannot run here; it is
for benchmarks/gpu_check.py on a machine that has one."""

import os

import pytest
import torch

from memfit.runtime.mem_pools import PhasePools, use_expandable_segments

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU no-op path")


@no_cuda
def test_expandable_segments_is_a_no_op_without_cuda(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert use_expandable_segments(True) is False
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_a_contrary_setting_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    with pytest.raises(ValueError, match="already sets expandable_segments:False"):
        use_expandable_segments(True)
    with pytest.raises(ValueError, match="must be True or False"):
        use_expandable_segments("yes")


@no_cuda
def test_phase_pools_do_nothing_without_cuda():
    with PhasePools("phase-pools") as pools:
        assert not pools.active and pools.pools == {}
        for phase in ("forward", "backward", "optimizer"):
            pools.on_phase(phase)
    with pytest.raises(ValueError, match="unknown phase 'warmup'"):
        pools.on_phase("warmup")


def test_schemes_without_a_pytorch_setting_are_refused():
    with pytest.raises(ValueError, match="no PyTorch setting can"):
        PhasePools("class-pools")
    with pytest.raises(ValueError, match="scheme must be one of"):
        PhasePools("per-tensor")


def test_the_running_setting_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    from memfit.runtime.mem_pools import allocator_expandable

    assert allocator_expandable() is False
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    assert allocator_expandable() is True
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")   # the newer name wins
    assert allocator_expandable() is False


def test_a_setting_already_in_force_is_not_refused_after_cuda_starts(monkeypatch):
    """CUDA's state patched: no GPU here to start an allocator."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert use_expandable_segments(True) is True
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert use_expandable_segments(False) is True          # the default is in force
    with pytest.raises(RuntimeError, match="CUDA is already initialised"):
        use_expandable_segments(True)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ     # nothing set that nobody reads
