"""The seed's memory table: XLM-R base and large x sequence length x fp32 / fp16 AMP x
checkpointing off / on x batch size, predicted for a GPU, and memfit's own plan as last rows.

Note 1 (the same numbers as ``memfit estimate``). Each row is one ``memfit.estimate`` call with
exactly the arguments ``memfit estimate --model M --batch-size B --seq-len S --precision P
[--checkpoint all] --gpu G`` passes (model on the meta device, the zoo's batch, AdamW, the
default allocator): a row's bytes are that command's, by construction, and a test holds a
sample of rows to it.

Note 2 (cost, and the cache). A trace's time depends on the number of ops, not on batch or length,
so the rows that differ only in batch size and length (one model, precision and checkpointing) are
one group with one trace, its batch and length symbolic, replayed in each row's shape
(``estimate_group``; ``memfit.api._shared_shapes``: a shape is replayed only where its trace would
run the same ops, every guard the shared trace recorded holds, so each row's figures are still
``memfit estimate``'s; a row where that fails is traced alone). A shared trace of XLM-R large takes
about 10 s on a quiet core. A row's result is kept in ``~/.cache/memfit/bench-seed/`` (or
``MEMFIT_CACHE``) under a key of the row, the device, torch's version and a hash of memfit's own
source files (less the command line, this package, reports and integrations, which no estimate
runs), so a rerun costs nothing and any change to what estimates traces again. ``use_cache=False``
ignores it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = ["Row", "seed_rows", "estimate_row", "estimate_group", "group_key", "plan_row",
           "cache_key", "cached_result", "MODELS", "SEQ_LENS"]

MODELS = ("xlm-roberta-base", "xlm-roberta-large")
SEQ_LENS = (128, 256, 512)
PRECISIONS = ("fp32", "fp16")
CHECKPOINTS = ("none", "all")


@dataclass(frozen=True)
class Row:
    model: str
    seq_len: int
    precision: str            # fp32 | fp16 (AMP autocast with loss scaling)
    checkpoint: str           # none | all
    batch_size: int
    tiny: bool = False        # the zoo's tiny twin (tests)


def seed_rows(models=MODELS, seq_lens=SEQ_LENS, batch_sizes=(8, 16, 32), precisions=PRECISIONS,
              checkpoints=CHECKPOINTS, tiny: bool = False) -> list[Row]:
    return [Row(m, s, p, c, b, tiny) for m in models for s in seq_lens for p in precisions
            for c in checkpoints for b in batch_sizes]


_SOURCE_HASH: str | None = None
# memfit's packages that take no part in an estimate or a plan (their edits keep the cache)
_NOT_ESTIMATE = ("cli", "train", "report", "integrations")


def _source_hash() -> str:
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            if path.relative_to(root).parts[0] in _NOT_ESTIMATE:
                continue
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
        _SOURCE_HASH = h.hexdigest()[:16]
    return _SOURCE_HASH


def cache_key(kind: str, row: Row, device) -> str:
    import torch

    text = json.dumps([kind, asdict(row), device.name, device.cuda_version,
                       device.module_loading, device.usable_bytes, torch.__version__,
                       _source_hash()])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _cache_dir() -> Path:
    return Path(os.environ.get("MEMFIT_CACHE") or Path.home() / ".cache" / "memfit") / "bench-seed"


def cached_result(kind: str, row: Row, device) -> dict | None:
    """The cached result of ``kind`` ("estimate" or "plan") for ``row``, or None."""
    path = _cache_dir() / f"{cache_key(kind, row, device)}.json"
    if path.is_file():
        try:
            return {**json.loads(path.read_text()), "cached": True}
        except ValueError:
            pass                                  # a damaged entry: trace again
    return None


def _cached(kind: str, row: Row, device, use_cache: bool, compute) -> dict:
    hit = cached_result(kind, row, device) if use_cache else None
    if hit is not None:
        return hit
    result = compute()
    if use_cache:
        _store(kind, row, device, result)
    return {**result, "cached": False}


def _store(kind: str, row: Row, device, result: dict) -> None:
    path = _cache_dir() / f"{cache_key(kind, row, device)}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)
    except OSError:
        pass                                      # a read-only home: no cache, same numbers


_MODELS: dict = {}


def _model(name: str, tiny: bool):
    """The model on the meta device, as ``memfit estimate`` builds it (cli._common.build_model)."""
    key = (name, tiny)
    if key not in _MODELS:
        from transformers.utils import logging

        from memfit import zoo

        logging.set_verbosity_error()
        spec = zoo.get(name)
        _MODELS[key] = (spec, spec.build(None, tiny=tiny, device="meta"))
    return _MODELS[key]


def _batch(row: Row):
    spec, model = _model(row.model, row.tiny)
    return spec.make_batch(model, row.batch_size, seq_len=row.seq_len, image_size=None,
                           padded=False, task=None)


def _estimate_kwargs(row: Row, device) -> dict:
    """``memfit estimate``'s arguments for the row's flags (cli.estimate)."""
    from memfit.trace.allocator import AllocatorConfig

    return dict(optimizer="adamw", device=device, budget=None, precision=row.precision,
                micro_batch_size=None,
                checkpoint=None if row.checkpoint == "none" else row.checkpoint, offload=None,
                offload_optimizer=None, remat=None, zero_grad=None,
                allocator=AllocatorConfig(expandable_segments=False))


def _figures(est, shared: bool) -> dict:
    return {"peak_bytes": est.peak_bytes, "reserved_bytes": est.reserved_bytes,
            "device_bytes": est.device_bytes, "fits": est.fits, "limit_bytes": est.limit_bytes,
            "trace_seconds": est.trace_seconds, "shared_trace": shared}


def estimate_row(row: Row, device, use_cache: bool = True) -> dict:
    """The row's ``memfit estimate`` figures (Note 1), from its own trace."""
    def compute() -> dict:
        from memfit.api.estimate import estimate

        _, model = _model(row.model, row.tiny)
        return _figures(estimate(model, _batch(row), **_estimate_kwargs(row, device)),
                        shared=False)
    return _cached("estimate", row, device, use_cache, compute)


def group_key(row: Row) -> tuple:
    """Rows with one key differ only in batch size and length: one shared trace (Note 2)."""
    return (row.model, row.precision, row.checkpoint, row.tiny)


def estimate_group(rows: list[Row], device, use_cache: bool = True) -> list[dict]:
    """``estimate_row`` of each row of one group (one ``group_key``), from one shared trace where
    it holds (Note 2); cached rows are read, the others traced and cached."""
    from memfit.api._shared_shapes import estimate_shapes

    out: list[dict | None] = [cached_result("estimate", r, device) if use_cache else None
                              for r in rows]
    todo = [r for r, got in zip(rows, out) if got is None]
    if todo:
        first = todo[0]
        _, model = _model(first.model, first.tiny)
        shapes = [{"batch": r.batch_size, "seq": r.seq_len} for r in todo]
        make = lambda s: _batch(replace(first, batch_size=s["batch"], seq_len=s["seq"]))
        kwargs = _estimate_kwargs(first, device)
        results = estimate_shapes(model, make, shapes, kwargs.pop("optimizer"),
                                  kwargs.pop("device"), **kwargs)
        done = iter(_figures(e, e.shared) for e in results)
        for i, got in enumerate(out):
            if got is None:
                fresh = next(done)
                if use_cache:
                    _store("estimate", rows[i], device, fresh)
                out[i] = {**fresh, "cached": False}
    return out


def plan_row(model_name: str, seq_len: int, batch_size: int, device, tiny: bool = False,
             use_cache: bool = True) -> dict:
    """``memfit plan --model M --batch-size B --seq-len S --gpu G``'s choice (precision auto)."""
    row = Row(model_name, seq_len, "auto", "auto", batch_size, tiny)

    def compute() -> dict:
        from memfit.api.plan import plan
        from memfit.modes import Mode

        _, model = _model(model_name, tiny)
        p = plan(model, _batch(row), None, "adamw", device, precision="auto")
        modes = sorted(set(p.blocks.values()))
        return {"precision": p.knobs.precision,
                "micro_batch_size": p.knobs.micro_batch_size or batch_size,
                "blocks": "/".join(modes) if modes else Mode.KEEP.value,
                "recompute_blocks": sum(m == Mode.RECOMPUTE for m in p.blocks.values()),
                "offload_optimizer": bool(p.knobs.offload_optimizer),
                "peak_bytes": p.predicted_peak_bytes, "reserved_bytes": p.predicted_reserved_bytes,
                "device_bytes": p.predicted_device_bytes,
                "step_time_ratio": p.predicted_step_time_ratio}
    return _cached("plan", row, device, use_cache, compute)
