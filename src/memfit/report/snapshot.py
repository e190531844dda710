"""A traced step as a PyTorch memory snapshot: what ``torch.cuda.memory._snapshot()`` returns
(pickled by ``torch.cuda.memory._dump_snapshot``), so that ``torch.cuda._memory_viz`` and
PyTorch's web viewer (pytorch.org/memory_viz) open a *predicted* step as they open a measured
one.

Note 1 (the format, as ``_memory_viz`` and ``MemoryViz.js`` read it). ``segments``: every segment
the allocator holds when the snapshot is taken, each with its ``blocks`` in address order covering
it whole (``active_allocated`` with ``size``, ``requested_size`` and ``frames``, or ``inactive``).
``device_traces``: per device, the events since recording began: ``segment_alloc`` /
``segment_free`` (cudaMalloc / cudaFree), ``alloc`` and ``free_requested`` + ``free_completed``
(each with the block's address, the requested size and frames). The viewer walks the trace back from
the segments, so blocks alive in the segments and absent from the trace were allocated before it
began: here, before the counted step (the events before it shape the state it starts from), as with
``_record_memory_history`` started at the step's first op.

Note 2 (frames). A real snapshot's frames are the Python and C++ stack of each allocation.
A trace has what matters of it: the aten op (``filename`` "aten", ``line`` its op index in the
step), the modules running it, innermost first (``filename`` the qualified name, ``name``
"Class.forward" or ".backward"), then the step's phase and micro-batch and the bytes'
category (``filename`` "memfit"). Flame graphs (``_memory_viz.memory``) thus nest by module.

Note 3 (when it is taken). ``at="end"`` (default): after the step's last op, the whole step in
the trace. ``at="peak"``: right after the op at the allocated peak, so that the segments hold
what is live at the peak (``_memory_viz.memory``'s active bytes sum to ``est.peak_bytes``), as a
snapshot dumped on an out-of-memory error would.
"""

from __future__ import annotations

import pickle

from memfit.measure import CATEGORIES
from memfit.report._ops import STEP, annotate
from memfit.report._replay import replay

__all__ = ["snapshot", "write_snapshot"]


def _frames_fn(est):
    info = annotate(est)
    cache: dict = {}

    def frames(op: int, category: int) -> list[dict]:
        key = (op, category)
        if key in cache:
            return cache[key]
        cat = CATEGORIES[category]
        if op < 0:
            out = [{"filename": "memfit", "line": 0, "name": f"before the step: {cat}"}]
        else:
            phase = info.phase[op]
            out = [{"filename": "aten", "line": op, "name": info.op[op]}]
            for m in info.parents(info.module[op]):
                kind = info.module_type.get(m, "")
                out.append({"filename": m or "(root)", "line": 0,
                            "name": f"{kind}.{'backward' if phase == 'backward' else 'forward'}"})
            mb = info.micro_batch[op]
            out.append({"filename": "memfit", "line": 0,
                        "name": f"{phase}" + (f" micro-batch {mb}" if mb else "")})
            out.append({"filename": "memfit", "line": 0, "name": cat})
            if info.module[op] == STEP:
                out[1:1] = [{"filename": "memfit", "line": 0, "name": "step"}]
        cache[key] = out
        return out

    return frames


def snapshot(est, tracker, *, at: str = "end", allocator=None) -> dict:
    """The snapshot dict of ``est``'s step (module Notes); ``tracker``: its trace's record
    (``report._capture.traced``); ``allocator``: the ``AllocatorConfig`` it was estimated with.
    """
    if at not in ("end", "peak"):
        raise ValueError(f"at={at!r}: write 'end' (after the step) or 'peak' (after the op at "
                         "the allocated peak)")
    if allocator is not None and allocator.expandable_segments:
        raise ValueError("a snapshot of expandable segments is not written yet (their pages "
                         "map inside one range): estimate without expandable_segments for the "
                         "snapshot")
    frames = _frames_fn(est)
    stop = None
    if at == "peak":
        curve = replay(est, tracker, allocator=allocator).allocated
        stop = max(range(len(curve)), key=curve.__getitem__)
    r = replay(est, tracker, allocator=allocator, frames=frames, stop_after_op=stop)
    settings = {"expandable_segments": False, "max_split_size": -1,
                "memfit": {"predicted": True, "basis": est.basis, "device": est.device.name,
                           "at": at, "peak_bytes": est.peak_bytes,
                           "reserved_bytes": est.reserved_bytes}}
    return {"segments": r.segments, "device_traces": [r.trace], "allocator_settings": settings}


def write_snapshot(path: str, est, tracker, *, at: str = "end", allocator=None) -> str:
    """Pickle ``snapshot(...)`` to ``path`` as ``torch.cuda.memory._dump_snapshot`` does."""
    data = snapshot(est, tracker, at=at, allocator=allocator)
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return path
