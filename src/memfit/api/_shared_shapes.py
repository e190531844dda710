"""``estimate_shapes``: one GPU step's memory in several batch shapes, from one trace.

Note 1 (why). A trace costs the same whatever the batch's size: it is Python's dispatch of each op
through the tracing modes, not arithmetic. A table whose rows differ only in batch size and length
(``memfit bench seed``) can therefore trace once with those dimensions symbolic (``trace.symbolic``)
and replay the counted ledger in each shape: every storage's size is an expression of the symbols
(the ledger keeps each event's ``SymInt`` expression), and the caching allocator model replays the
same births and deaths with that shape's sizes. A shared trace costs about twice a plain one
(sympy), so it pays from the second shape on.

Note 2 (when it holds). A shape is replayed only where the trace in that shape would run the same
ops: every decision the trace took on a symbolic size (a Python comparison of a ``SymInt``, in
PyTorch's decompositions, the model's code or memfit's kernel models) is one of the shape
environment's guards, and the shape must satisfy every one of them; and its batch must be the traced
one in that shape (every dimension that changes is a symbol: a decoder's labels whose length follows
the input's would keep the traced length otherwise), each of its tensors owning a contiguous storage
of its own (a slice of a longer buffer counts the whole buffer; two views of one storage count it
once). A shape that does not, or whose sizes are not all >= 2, is traced on its own, as is every
shape when the shared trace fails (e.g. a data-dependent op: the shared trace knows no batch values,
so it cannot resolve one), for a CPU target, and for one rank of a sharded job. So each figure is
what ``estimate`` gives for that shape.

Note 3 (what it gives). Per shape: the allocated and reserved peaks of step 2 and the device
bytes with the card's lines outside the allocator, i.e. the figures a table shows. The timeline,
breakdown, modules and FLOPs of an ``Estimate`` are the traced shape's only, so none is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from memfit.api._setup import resolve_device
from memfit.api._rank_layout import is_sharded
from memfit.api.estimate import estimate, traced_estimate
from memfit.knobs import Knobs
from memfit.step import prepare_batch
from memfit.trace.card import card_breakdown
from memfit.trace.symbolic import SymbolicCopier

__all__ = ["ShapeEstimate", "estimate_shapes"]


@dataclass(frozen=True)
class ShapeEstimate:
    """One shape's figures (Note 3), equal to ``estimate``'s for that shape. Bytes."""

    peak_bytes: int
    reserved_bytes: int
    device_bytes: int
    limit_bytes: int
    trace_seconds: float         # the trace it comes from (shared by several shapes, or its own)
    shared: bool                 # replayed from a shared trace, else traced on its own

    @property
    def fits(self) -> bool:
        return self.device_bytes <= self.limit_bytes


def estimate_shapes(model, make_batch: Callable[[dict[str, int]], object],
                    shapes: list[dict[str, int]], optimizer="adamw", device=None,
                    loss_fn=None, *, budget=None, allocator=None, **knobs) -> list[ShapeEstimate]:
    """``estimate(model, make_batch(shape), ...)`` for each shape (a dict of dimension name ->
    size, e.g. ``{"batch": 8, "seq": 128}``), for a GPU ``device``, from one trace where it
    holds (Notes 1-2). In ``make_batch(shape)``'s tensors, a dimension equal to one of the
    shape's sizes is that dimension: give shapes whose sizes differ from each other and from
    the batch's other dimensions."""
    k = Knobs.from_kwargs(**knobs)
    kwargs = dict(optimizer=optimizer, device=device, loss_fn=loss_fn, budget=budget,
                  allocator=allocator, **{n: v for n, v in k.to_dict().items() if v is not None})
    hint = next((s for s in shapes if min(s.values()) >= 2
                 and len(set(s.values())) == len(s)), None)
    # a CPU target has no replay to share; one rank of a sharded job is estimate's other path
    gpu = resolve_device(model, device).kind == "cuda" and not is_sharded(k)
    shared = _shared_trace(model, make_batch, hint, k, kwargs) \
        if gpu and hint and len(shapes) > 1 else None
    out = []
    for shape in shapes:
        got = shared(shape) if shared is not None else None
        if got is None:
            est = estimate(model, make_batch(shape), **kwargs)
            got = ShapeEstimate(est.peak_bytes, est.reserved_bytes, est.device_bytes,
                                est.limit_bytes, est.trace_seconds, shared=False)
        out.append(got)
    return out


def _shared_trace(model, make_batch, hint: dict[str, int], k: Knobs, kwargs: dict):
    """``shape -> ShapeEstimate | None`` from one symbolic trace at ``hint``, or None where the
    shared trace cannot run (Note 2)."""
    copier = SymbolicCopier("cpu", {v: n for n, v in hint.items()})
    traced = prepare_batch(make_batch(hint))    # estimate's own first step, done here so that
                                                 # the batches compared are the ones traced
    try:
        est, tracker, cuda = traced_estimate(
            model, traced, kwargs["optimizer"], kwargs["device"], kwargs["loss_fn"],
            k, copier, budget=kwargs["budget"], allocator=kwargs["allocator"])
    except Exception as e:       # noqa: BLE001 - each shape is then traced on its own (Note 2)
        logging.getLogger(__name__).info("no shared trace, each shape traced alone: %s", e)
        return None

    def one(shape: dict[str, int]) -> ShapeEstimate | None:
        if set(shape) != set(hint) or not copier.holds(shape) or \
                not copier.same_batch(traced, prepare_batch(make_batch(shape)), shape):
            return None
        if shape == hint:
            return ShapeEstimate(est.peak_bytes, est.reserved_bytes, est.device_bytes,
                                 est.limit_bytes, est.trace_seconds, shared=True)
        try:
            peak, reserved, _, workspace = cuda.replay_peaks(tracker, copier.sizes(shape))
        except ValueError:
            return None
        card = card_breakdown(cuda.spec, reserved, est.op_log, workspace)
        return ShapeEstimate(peak, reserved, reserved + card.outside_allocator_bytes,
                             est.limit_bytes, est.trace_seconds, shared=True)
    return one
