"""The planner's floor: the least device bytes of any configuration in the search space, traced.

Note 1 (which candidates). ``planner.search.floor_candidates`` proposes them (search:
the least-memory modes at micro-batch 1 and at the whole batch, and uniform recompute /
offload beside them); each is traced and the least traced is the floor. Candidates the models
put more than ``FLOOR_PRUNE`` above both their least and the least traced so far are not traced
(``planner.verify.least_traced``: a model far too optimistic must not hide the least; the
uniform variants are needed:
on tiny gpt2 the least traced is uniform recompute at micro-batch 1, which the models put above
their mixed least).

Note 2 (tracing a candidate cheaply). A candidate of n >= 4 whole micro-batches of m is traced
at 2m and 3m samples and extrapolated, as ``largest_fitting`` does (levers): every
micro-batch past the first sees the same live state, so the peak is linear in the samples (to
the byte on a CPU). The slope is what one more micro-batch keeps alive until the step ends: its
inputs (the caller's batch is alive throughout) and its loss weight. That does not depend on
the per-block modes or where the optimizer state lives, so it is traced once per (precision,
micro-batch size) and shared by the candidates after the first: each further candidate costs one
trace of 2m samples, not two.

Note 3 (CUDA). The least is found on traces without the allocator replay, then traced whole
with it, under the allocator setting the plan would choose (``api._plan_allocator``): the floor
is then exact, as a plan's bytes are, and never above a plan the same search finds (issue 27:
the bound from 2m samples plus the linear term, under the default allocator, was 2 KiB above a
plan on tiny gpt2 and 416 MiB above one on gpt2, 4 x 128, on a GTX 1080 Ti). A trace without the
replay counts allocated bytes, which the allocator's reserved bytes never go below, so it is a
bound: the next candidate is confirmed too while its bound is below the least confirmed, one
for each way the training state is placed (``planner.search.state_placement``: candidates
placed alike fragment alike, so a second of them is not confirmed). Where the replay puts the
least more than ``FLOOR_PRUNE`` above its bound, the models' ranking is no guide: the other
ways of placing the state are proposed and traced too (``floor_candidates(...,
other_placements=True)``), and confirmed the same way. Block weights fetched and dropped per
block fragment the allocator most: on llama-1b, 8 x 2 tokens on a GTX 1080 Ti, parameter
offload's 6.56 GiB without the replay is 11.11 GiB with it, and the gradients on the host,
7.54 GiB without, are the floor at 8.21 GiB. gpt2, 4 x 64 on a T4: the floor was 1.96 GB
and is 1.65 GB, at 32 traces instead of 21 (89 s against 55 s for ``--floor``).

Note 4 (the longest sequence). When even the floor misses the budget, ``BudgetTooSmall`` says
how long an input the floor's configuration could hold: the batch's tensors that share its sequence
length (dimension 1 of every tensor of two or more dimensions: ids, masks, labels) are cut to a
shorter length, and a bisection over the length traces the configuration at each (without the
allocator replay, plus the CUDA context), then confirms the answer with the replay (on a GPU those
are the bytes the budget caps), bisecting below it where that fails. A batch without such a
dimension (images), or without an integer tensor along it (ids, a mask: a float ``(batch,
features)`` input has no sequence), has no sequence lever.

Note 5 (the bound before any trace, issue 26). What every configuration the search could pick
keeps on the device is known from the parameters alone: the gradients of the trainable parameters
(all alive when backward ends, whatever the micro-batches, recompute, offload or optimizer
placement: parameter offload releases weights, never gradients, ``techniques.param_offload``), the
weights no lever moves to the host (frozen ones always; trainable ones unless parameter offload is
open), the optimizer state where no lever moves it (Adam's, counted exactly by
``low_bit_optimizer.state_bytes`` at the least state the search may pick; another optimizer's as 0)
and, on a GPU, the CUDA context. Each precision the search weighs gets its own sum (bf16-pure:
16-bit weights and gradients, its fp32 masters not counted) and the least is the bound. Every term
is part of what the traced floor counts, so the bound is at most the floor and a budget under it is
refused at once (``plan``) with the floor's own message. One assumption: every trainable parameter
gets a gradient; one the loss never reaches (an unused pooler) has none, and the bound is then high
by its bytes, less than what one sample's activations add to the floor on any model seen. Where
the search may step the optimizer in backward (fp32 or bf16, ``optimizer_in_backward``), the
gradients are never all alive: only the largest one is certain, and the bound counts that one
(with the weights and the optimizer state on the device: that lever moves neither to the host);
so where it may move each gradient to the host as backward makes it (``offload_gradients``,
the weights on the device: it does not combine with parameter offload).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map

from memfit.api._choice import describe, knob_values
from memfit.api._stages import Stages
from memfit.api.estimate import estimate
from memfit.planner.search import floor_candidates, state_placement
from memfit.planner.variants import GRAD_OFFLOAD_PRECISIONS, IN_BACKWARD_PRECISIONS
from memfit.planner.verify import FLOOR_PRUNE, traced_candidates
from memfit.techniques.accumulation import Accumulation
from memfit.techniques.low_bit_optimizer import STATES, state_bytes

__all__ = ["FLOOR_PRUNE", "least_memory", "first_samples", "longest_sequence", "Bound",
           "lower_bound"]

def least_memory(model, batch, models, fixed, k, common, held, b, say, alloc=None,
                 stages_after: int = 0):
    """The floor (Note 1): the candidates ``floor_candidates`` gives, traced; the least
    (``planner.verify.least_traced``). ``alloc``: the plan's ``AllocatorChoice``, whose setting
    the floor is counted under on a GPU (Note 3). ``stages_after``: the stages the caller runs
    after the floor, for the ETA's count (``say`` a ``Stages``).

    Returns ``(device_bytes, choice, estimate)``; ``estimate`` is None where the floor was
    extrapolated (Note 2) and must be traced whole before it becomes a plan."""
    slopes: dict = {}

    def trace(c):
        values = knob_values(c, models[c.key][0].blocks, k)
        shape = (c.precision, c.micro_batch_size)
        total, est, slope = _accumulated_bytes(model, batch, c, values, common, b,
                                               slope=slopes.get(shape))
        slopes.setdefault(shape, slope)
        return total + held[c.precision], (values, est)

    def ident(c):
        values = knob_values(c, models[c.key][0].blocks, k)
        return c.precision, tuple(sorted((n, str(v)) for n, v in values.items()))

    candidates = list(floor_candidates(models, b, fixed))
    if isinstance(say, Stages):          # an ETA's count: each candidate and the confirmation
        say.expect(len(candidates) + (common["device"].kind == "cuda") + stages_after)

    def traced_of(cands):
        return traced_candidates(cands, predicted=lambda c: c.device_bytes, ident=ident,
                                 trace=trace, say=say, describe=lambda c: describe(c, b))

    traced = traced_of(candidates)
    if common["device"].kind != "cuda":          # a CPU trace is exact: nothing to confirm
        total, c, (values, est) = traced[0]
        return total, c, est
    confirmed: dict[str, tuple] = {}             # per way the state is placed (Note 3)

    def confirm(traced, best):
        for bound, c, (values, _) in traced:     # the least first; each a bound (Note 3)
            if best is not None and bound >= best[0]:
                break
            if state_placement(c.key) in confirmed:
                continue
            say("confirming the least-memory configuration with the allocator replayed")
            est = estimate(model, batch, precision=c.precision, allocator_replay=True,
                           **values, **common)    # whole: exact, not a bound (Note 3)
            saved = alloc.saved(est) if alloc is not None else 0
            total = est.device_bytes + held[c.precision] - saved
            confirmed[state_placement(c.key)] = bound, total
            if best is None or total < best[0]:
                best = total, c, est
        return best

    best = confirm(traced, None)
    bound, replayed = confirmed[state_placement(best[1].key)]
    if replayed > FLOOR_PRUNE * bound:           # far off: the other placements (Note 3)
        others = floor_candidates(models, b, fixed, other_placements=True)
        if others:                               # a model of one placement has none
            best = confirm(sorted(traced + traced_of(others), key=lambda t: t[0]), best)
    return best


def _accumulated_bytes(model, batch, c, values, common, b, *, slope: int | None = None):
    """Device bytes of candidate ``c``, traced without the allocator replay (Note 3); with four
    or more whole micro-batches from 2m samples plus ``slope`` per further micro-batch (traced
    at 3m when not given, Note 2). Returns ``(bytes, estimate or None if extrapolated, slope or
    None)``."""
    m = c.micro_batch_size
    n = b // m
    if m < b and b % m == 0 and n >= 4:
        two = estimate(model, first_samples(batch, 2 * m), precision=c.precision,
                       allocator_replay=False, **values, **common).device_bytes
        if slope is None:
            slope = max(estimate(model, first_samples(batch, 3 * m), precision=c.precision,
                                 allocator_replay=False, **values, **common).device_bytes - two, 0)
        return two + (n - 2) * slope, None, slope
    est = estimate(model, batch, precision=c.precision, allocator_replay=False, **values,
                   **common)
    return est.device_bytes, est, None


def first_samples(batch, n: int):
    """The first ``n`` samples, in storages of their own (a view would count the whole)."""
    part = Accumulation(Accumulation.Config(n)).split(batch)[0]
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, part)


def longest_sequence(batch, fits, confirm=None) -> tuple[int | None, int] | None:
    """``(longest length whose batch fits, the batch's length)`` (Note 4); ``fits(batch)`` ->
    bool traces one (fast, no allocator replay), ``confirm(batch)`` (default ``fits``) settles
    the answer (replayed), lower lengths bisected by it where it fails. None when the batch has
    no sequence dimension; longest is None when even length 1 does not fit."""
    if not isinstance(batch, dict):
        return None
    lengths = {v.shape[1] for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim >= 2}
    tokens = any(isinstance(v, torch.Tensor) and v.ndim >= 2 and not v.is_floating_point()
                 for v in batch.values())       # ids or a mask: else dimension 1 is features
    if len(lengths) != 1 or not tokens:
        return None
    given = lengths.pop()
    if given < 2:
        return None

    def cut(n: int):
        return {k: v[:, :n].clone() if isinstance(v, torch.Tensor) and v.ndim >= 2 else v
                for k, v in batch.items()}

    def bisect(test, good: int, bad: int) -> int:
        while bad - good > 1:
            mid = (good + bad) // 2
            good, bad = (mid, bad) if test(cut(mid)) else (good, mid)
        return good

    good = bisect(fits, 0, given)
    if confirm is not None and good and not confirm(cut(good)):
        good = bisect(confirm, 0, good)
    return (good or None), given


@dataclass(frozen=True)
class Bound:
    """The floor's lower bound, from the parameters alone (Note 5); bytes on the device.
    ``params_bytes``, ``grads_bytes`` and ``optimizer_state_bytes`` are the job as given with
    everything on the device (what ``_plan_words.too_small`` names, as it does the traced
    floor's); ``bytes`` is the least over the configurations the search may pick."""

    bytes: int                     # the bound: the floor is at least this
    precision: str                 # the precision whose sum is the least
    params_bytes: int              # every weight, in its dtype
    grads_bytes: int               # one gradient per trainable weight
    optimizer_state_bytes: int     # fp32 Adam state (0 for another optimizer)


def lower_bound(params, *, precisions, optimizer_class, context_bytes: int,
                state_on_host: bool, params_on_host: bool, state: str | None,
                low_bit: bool, in_backward: bool = False, grads_to_host: bool = False) -> Bound:
    """Note 5. ``params``: the model's parameters (``requires_grad`` says which train);
    ``precisions``: those the search weighs; ``state_on_host`` / ``params_on_host``: whether
    the search may move the optimizer state / the block weights to the host; ``state``: a fixed
    ``optimizer_state`` (None: fp32, or a low-bit one where ``low_bit``); ``in_backward``: the
    search may step the optimizer in backward, ``grads_to_host``: move the gradients to the
    host in backward (fp32 and bf16 then hold one gradient at least)."""
    trainable = [p for p in params if p.requires_grad]
    frozen_bytes = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    train_bytes = sum(p.numel() * p.element_size() for p in trainable)
    adam = optimizer_class is not None and issubclass(optimizer_class, torch.optim.Adam) or \
        optimizer_class is not None and issubclass(optimizer_class, torch.optim.AdamW)
    states = [state] if state not in (None, "fp32") else \
        ["fp32", *(STATES if low_bit else ())]
    state_least = min(state_bytes(trainable, s) for s in states) if adam else 0
    fp32_state = state_bytes(trainable, "fp32") if adam else 0
    sums = {}
    for q in precisions:
        if q == "bf16-pure":        # 16-bit weights and gradients; state on the device
            half = sum(p.numel() * min(p.element_size(), 2) for p in params)
            sums[q] = half + sum(p.numel() * min(p.element_size(), 2) for p in trainable)
        else:
            sums[q] = frozen_bytes + (0 if params_on_host else train_bytes) + train_bytes + \
                (0 if state_on_host else state_least)
            largest = max((p.numel() * p.element_size() for p in trainable), default=0)
            if in_backward and q in IN_BACKWARD_PRECISIONS:    # weights, state on the device
                sums[q] = min(sums[q], frozen_bytes + train_bytes + largest + state_least)
            if grads_to_host and q in GRAD_OFFLOAD_PRECISIONS:  # weights on the device
                sums[q] = min(sums[q], frozen_bytes + train_bytes + largest)
    q = min(sums, key=sums.get)
    return Bound(sums[q] + context_bytes, q, frozen_bytes + train_bytes, train_bytes, fp32_state)
