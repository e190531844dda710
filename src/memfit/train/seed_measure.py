"""The seed table's rows measured on this machine's GPU: ``memfit bench seed``'s measured columns.

Note 1 (what is measured). Each row's step runs for real: the zoo model built with random
weights on the GPU, AdamW, the row's precision (fp16 autocast with a GradScaler) and
checkpointing, through ``memfit.fit`` with those knobs and no budget (so nothing else is
changed), on the row's batch. ``memfit.calibrate.measure_step`` gives step 2's
``max_memory_allocated``, ``max_memory_reserved`` and the device bytes used (``cudaMemGetInfo``),
the figures the predicted columns stand for, once the optimizer has stepped (under fp16 the
scaler skips the first steps until its scale is low enough, and AdamW's state is created at the
first real one). A row that runs out of memory (in the allocator or a library) says so, and the
next row starts clean.

Note 2 (one process). The rows run one after another in this process, each after
``empty_cache()``: the allocator starts empty but for what lives on between rows (the cuBLAS
workspaces, allocated once per process, and the CUDA context), which a process running only
that row holds too. The device bytes used count every process on the card. The predictions
assume PyTorch's default allocator settings; ``allocator_note`` says when
``PYTORCH_CUDA_ALLOC_CONF`` changes them here.
"""

from __future__ import annotations

import gc
import os

import torch

from memfit.train import seed_table as st

__all__ = ["measure_row", "allocator_note"]


def allocator_note() -> str | None:
    """A line when this process's allocator settings differ from the predictions' (Note 2)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")
    if not conf:
        return None
    return (f"PYTORCH_CUDA_ALLOC_CONF={conf} here, while the predictions assume the default "
            "allocator: unset it for comparable columns")


def _out_of_memory(e: BaseException) -> bool:
    """An allocation failure: the caching allocator's, or a library's (cuBLAS, cuDNN)."""
    text = str(e)
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text or \
        "ALLOC_FAILED" in text


def _reach_steady_state(runner, batch, most: int = 30) -> None:
    """Steps until the optimizer has stepped once (Note 1): under fp16 the scaler skips the
    first steps while its scale is too high, and AdamW's state appears only at a real step;
    ``measure_step``'s warm-up and measured steps then both find it."""
    inner = getattr(runner.optimizer, "inner", runner.optimizer)
    for _ in range(most):
        if inner.state:
            return
        runner.step_unguarded(batch)


def measure_row(row: st.Row) -> dict:
    """``measured_allocated_bytes``, ``measured_reserved_bytes``, ``measured_device_bytes`` of
    the row's step 2 on this machine's GPU, or all None with ``measured_oom`` (Note 1)."""
    from memfit.api.fit import fit
    from memfit import zoo
    from memfit.calibrate import measure_step, require_gpu

    require_gpu()
    spec = zoo.get(row.model)
    out = {"measured_allocated_bytes": None, "measured_reserved_bytes": None,
           "measured_device_bytes": None, "measured_oom": False}
    model = opt = runner = batch = None
    try:
        model = spec.build(None, tiny=row.tiny, device="cuda")
        batch = {k: v.cuda() for k, v in st._batch(row).items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        runner = fit(model, opt, batch, precision=row.precision,
                     checkpoint=None if row.checkpoint == "none" else row.checkpoint)
        _reach_steady_state(runner, batch)
        got = measure_step(runner.step_unguarded, batch)
        out.update(measured_allocated_bytes=got["measured_allocated_bytes"],
                   measured_reserved_bytes=got["measured_reserved_bytes"],
                   measured_device_bytes=got["measured_device_used_bytes"])
    except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
        if not _out_of_memory(e):
            raise
        out["measured_oom"] = True
    finally:
        if runner is not None:
            runner.close()
        del model, opt, runner, batch
        gc.collect()
        torch.cuda.empty_cache()
    return out
