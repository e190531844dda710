"""The CUDA estimate differs from the CPU trace in exactly the documented ways
(memfit.trace.cuda Note 1), each checked apart."""

import torch
from torch import nn

import memfit
from memfit.step import canonical_step
from memfit.trace.allocator import CachingAllocator, round_size
from memfit.trace.cuda import CudaModel
from tests.helpers import tiny

GPU = "a100-80gb"


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def loss_fn(m, b):
    return nn.functional.cross_entropy(m(b["x"]), b["y"])


BATCH = {"x": torch.randn(64, 256), "y": torch.randint(0, 10, (64,))}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, foreach=False)


def test_without_kernels_autocast_or_foreach_it_is_the_real_step_through_the_allocator():
    """A model with no attention, fp32, an optimizer without foreach: the only differences
    left are the caching allocator and the cuBLAS workspace. Replay the *real* CPU run's
    storages (two steps, tracked) through the allocator: the estimate must equal it."""
    model = mlp()
    opt = sgd(model.parameters())
    with memfit.track(model, opt) as t:
        canonical_step(model, opt, BATCH, loss_fn)
        t.start_window()
        canonical_step(model, opt, BATCH, loss_fn)
    spec = memfit.get_device(GPU)
    real = CudaModel(spec).replay(t)
    est = memfit.estimate(mlp(), BATCH, optimizer=sgd, device=GPU, loss_fn=loss_fn)
    assert est.peak_bytes == real.allocated_peak_bytes
    assert est.reserved_bytes == real.reserved_peak_bytes
    # and the allocator adds only rounding and the workspaces to the exact live bytes: the
    # calling thread's cuBLAS + cuBLASLt, and autograd's device thread's cuBLAS
    # (_device_cuda Note 1)
    exact = t.peak_bytes
    workspaces = spec.cublas_workspace_bytes + spec.autograd_workspace_bytes
    assert real.workspace_bytes == workspaces == 2 * spec.cublas_workspace_bytes - 1024**2
    assert exact + workspaces <= est.peak_bytes
    assert est.peak_bytes - exact - workspaces < 512 * 64


def test_context_is_added_on_top_of_reserved_and_fits_uses_it():
    est = memfit.estimate(mlp(), BATCH, optimizer=sgd, device="gtx-1080-ti", loss_fn=loss_fn)
    assert est.context_bytes == memfit.get_device("gtx-1080-ti").cuda_context_bytes > 0
    assert est.device_bytes == est.reserved_bytes + est.context_bytes
    tight = memfit.estimate(mlp(), BATCH, optimizer=sgd, device="gtx-1080-ti", loss_fn=loss_fn,
                            budget=est.reserved_bytes)
    assert not tight.fits and tight.to_dict()["validated"] is False


def test_foreach_adamw_holds_one_parameter_sized_temporary_at_its_peak():
    """CUDA's default AdamW is foreach: `_foreach_sqrt(exp_avg_sq)` makes one temporary per
    parameter, all alive together; the CPU default (per-tensor) holds one at a time."""
    params = sum(p.numel() * 4 for p in mlp().parameters())
    est = memfit.estimate(mlp(), BATCH, optimizer="adamw", device=GPU, loss_fn=loss_fn)
    assert est.breakdown["temporaries"] == params + 4        # + the 0-d fp32 loss kept
    cpu = memfit.estimate(mlp(), BATCH, optimizer="adamw", device="cpu", loss_fn=loss_fn)
    assert cpu.breakdown["temporaries"] < params


def test_adam_step_counters_live_on_the_host():
    n = len(list(mlp().parameters()))
    gpu = memfit.estimate(mlp(), BATCH, optimizer="adamw", device=GPU, loss_fn=loss_fn)
    cpu = memfit.estimate(mlp(), BATCH, optimizer="adamw", device="cpu", loss_fn=loss_fn)
    assert cpu.breakdown["optimizer"] - gpu.breakdown["optimizer"] == 4 * n


def test_attention_runs_the_gpus_kernel_and_saves_no_score_matrix():
    model, batch = tiny("gpt2", batch_size=2, seq_len=64)
    gpu = memfit.estimate(model, batch, "sgd", device=GPU, precision="fp16")
    cpu = memfit.estimate(model, batch, "sgd", device="cpu", precision="bf16")
    assert "flash" in gpu.notes[0]
    block = gpu.blocks[0]
    heads = model.config.n_head
    score_matrix = 2 * heads * 64 * 64 * 2          # B x H x L x L in 16-bit
    assert cpu.modules[block].saved_bytes - gpu.modules[block].saved_bytes >= score_matrix
    pascal = memfit.estimate(model, batch, "sgd", device="gtx-1080-ti", precision="fp16")
    assert "efficient" in pascal.notes[0]             # no flash before sm80


def test_replay_counts_rounded_blocks():
    a = CachingAllocator()
    a.malloc(1)
    assert a.stats.allocated_bytes == round_size(1) == 512
