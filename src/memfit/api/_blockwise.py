"""``estimate`` of a deep model from two shallow twins (``trace.block_reuse``).

A model of N repeated blocks is traced as twin A (5 blocks) and twin B (4 blocks), labelled by
block; the N-block step is composed from them and its figures are made by ``api._traced.figures``
as for a traced step. ``blockwise_estimate`` returns None, with the reason, where the step is
not composed and must be traced whole:

- fewer than ``MIN_BLOCKS`` blocks (twins of 5 and 4 blocks cost about what 12 blocks
  traced whole do, measured on gpt2 and BERT-base) unless both twins were traced already in
  this process: a twin is the same model at any depth (its config a copy at the twin's
  depth), so inside ``using(cache)`` the traced twins are kept in memory by their own key
  (docs/cache.md) and another depth composes from them; no single list of blocks, or middle
  blocks that differ (``trace._block_twin``);
- several GPUs (a rank's collectives), a shared symbolic trace, a quantized base (its twin is
  quantized whole), a compiled model (its regions are compiled for the model's own shapes,
  trace.compiled);
- a per-block mix of modes (a tuple or ``every:K`` of ``checkpoint``, ``offload`` or
  ``offload_params``): the twins would need one block per mode. Activation and parameter
  offload of every block compose (docs/block-reuse.md: the host pool's buffers freed
  together, the weights fetched ahead of their blocks);
- twins whose traces do not compose (``NotComposable``: block 1, 2 and 3 unlike, or A
  composed for four blocks is not B).

Figures outside the tracker that grow with the blocks (each SDPA call's kernel, paged optimizer
state) are taken affine in the blocks, as the composed tracker's are.
"""

from __future__ import annotations

from collections import Counter

from memfit.api import _trace_cache as trace_cache
from memfit.api._traced import Traced, trace_step
from memfit.api._rank_layout import RankLayout
from memfit.knobs import Knobs
from memfit.measure._compile_aware import has_compiled
from memfit.trace import FakeCopier
from memfit.trace._block_twin import BlockList
from memfit.trace.block_reuse import (MIN_BLOCKS, TWIN_A, TWIN_B, NotComposable, StepLog,
                                      compose)
from memfit.trace.first_step import NotMade
from memfit.trace.first_step import make as make_first_step
from memfit.trace.per_parameter import kinds_shared
from memfit.trace.profile import profile_of

__all__ = ["blockwise_estimate", "TOO_FEW"]

TOO_FEW = "blocks are too few to gain from composing"

_UNIFORM = (None, "none", "all", "selective")


def blocks_or_why(model, k: Knobs) -> BlockList | str:
    """The model's blocks, as many as the twins take at least, or why this job's step is
    traced whole (module docstring)."""
    if RankLayout.of(k) is not None:
        return "several GPUs are traced whole"
    if k.quantize_base not in (None, "none"):
        return "a quantized base is traced whole"
    for name in ("checkpoint", "offload", "offload_params"):
        policy = getattr(k, name)
        if policy not in _UNIFORM and policy != "every:1":     # every:1 is every block
            return f"{name}={policy!r} mixes modes across blocks"
    if has_compiled(model):
        return "a compiled model is traced whole"
    blocks = BlockList.of(model)
    if not isinstance(blocks, str) and blocks.count < len(TWIN_A(0)):
        return f"{blocks.count} {TOO_FEW}"
    return blocks


def blockwise_estimate(model, batch, optimizer, device, loss_fn, k: Knobs, *,
                       min_blocks: int | None = None, **kwargs
                       ) -> tuple[Traced | None, str | None]:
    """(the composed step as ``figures`` takes it, None), or (None, why it was not composed).
    ``min_blocks``: fewer blocks are traced whole (default ``MIN_BLOCKS``: the twins would
    cost about as much)."""
    blocks = blocks_or_why(model, k)
    if isinstance(blocks, str):
        return None, blocks
    n = blocks.count
    depths = [len(TWIN_A(n)), len(TWIN_B(n))]
    twins = [blocks.twin(indices) for indices in (TWIN_A(n), TWIN_B(n))]
    keys = [trace_cache.key_for(twin, batch, optimizer, device,
                                dict(knobs=k, twin=True, loss_fn=loss_fn, **kwargs))
            for twin in twins]
    kept = [trace_cache.twin_lookup(key) for key in keys]
    least = MIN_BLOCKS if min_blocks is None else min_blocks
    if n < least and None in kept:      # the twins would cost about what the model does
        return None, f"{n} {TOO_FEW}"
    logs, traced = [], []
    with kinds_shared():          # twin B repeats twin A's per-parameter updates
        for twin, depth, key, got in zip(twins, depths, keys, kept):
            if got is None:
                t = trace_step(twin, batch, optimizer, device, loss_fn, k, FakeCopier("cpu"),
                               blocks=blocks.names(depth), **kwargs)
                got = (t, StepLog.of(t.tracker, blocks.path, depth))
                trace_cache.twin_store(key, got)
            t, log = got
            if len(set(t.knobs_blocks.values())) > 1:
                return None, "the knobs give the blocks different modes"
            traced.append(t)
            logs.append(log)
    try:
        composed = compose(logs[0], logs[1], n)
    except NotComposable as e:
        return None, str(e)
    a, b = traced
    tracker = composed.tracker
    if a.first_made:              # the replay's first step, made on the composed step
        try:
            make_first_step(tracker)
        except NotMade:
            return blockwise_estimate(model, batch, optimizer, device, loss_fn, k,
                                      min_blocks=min_blocks, **{**kwargs, "first_step": False})
    window_a = len(a.tracker.op_events) - len(a.tracker.window_op_log)
    window = len(tracker.op_events) - len(tracker.window_op_log)
    phases = {}
    for name, op in a.prof.phases.items():
        where = composed.op_index.get(window_a + op)
        if where is None:
            return None, f"the step's phase {name!r} starts inside a repeated block"
        phases[name] = where - window
    prof = profile_of(tracker, phases, a.prof.trace_seconds + b.prof.trace_seconds)
    extra = n - len(TWIN_A(n))
    mode = next(iter(a.knobs_blocks.values()), None)
    return Traced(
        spec=a.spec, knobs=a.knobs, user=a.user, layout=None, cuda=a.cuda, runner=a.runner,
        quantized=None, limit=a.limit, budget=a.budget, batch=a.batch, replay=a.replay,
        prof=prof, tracker=tracker,
        knobs_blocks={name: mode for name in blocks.names()} if a.knobs_blocks else {},
        sdpa_calls=_affine_calls(a.sdpa_calls, b.sdpa_calls, extra),
        unified_bytes=a.unified_bytes + extra * (a.unified_bytes - b.unified_bytes),
        layerdrop=a.layerdrop,
        traced_as=f"composed from twins of {len(TWIN_A(n))} and {len(TWIN_B(n))} of its "
                  f"{n} blocks"), None


def _affine_calls(a: list[str], b: list[str], extra: int) -> list[str]:
    ca, cb = Counter(a), Counter(b)
    out = []
    for kernel in dict.fromkeys(a):
        out += [kernel] * (ca[kernel] + extra * (ca[kernel] - cb[kernel]))
    return out
