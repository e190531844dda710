"""The planner's search: the fastest predicted configuration whose predicted bytes fit.

Note 1 (what is searched). Precision (the candidates the caller passes) x micro-batch size (1..b) x
optimizer-state offload x one mode per block (``memory_model.MODES``). For each outer choice the
per-block modes are a small MILP, solved exactly with scipy's HiGHS: binary x[i, mode], one mode per
block, minimise the time the modes add (a recompute reruns the block's forward ops, an offload pays
what the neighbouring compute cannot hide) subject to every candidate peak point (each block's
forward and backward peaks, the stretches between blocks, the optimizer step: each linear in x) <=
the cap. Keeping every block, when it fits, is optimal (no mode is faster than keep), so the MILP
runs only where that does not fit. Bytes enter the MILP in MiB and times in milliseconds, to keep
HiGHS well scaled.

Ties (the same predicted time, e.g. micro-batches 4 and 6 of 8 both run two) go to the
smallest micro-batch: the least memory, and chunks as even as they can be.

Note 2 (pruning). Among micro-batches that accumulate (``m < b``) memory grows with ``m``, so once
even the least-memory modes do not fit at some ``m < b``, no larger ``m < b`` does; the search then
tries ``m = b`` alone. That one can need *less* than ``m = 1``: without accumulation no gradient is
alive during the forward (every micro-batch after the first runs with all gradients alive). The
floor is therefore the lesser of ``m = 1`` and ``m = b``.

Note 3 (what the caller fixed). Each block takes only the modes ``Constraints`` allows it
(``planner.choice``: a fixed ``checkpoint`` or ``offload`` fixes its own side, the other stays
free), the micro-batch the caller fixed, and the optimizer placement.

Note 4 (variants). ``models`` is keyed by ``(precision, optimizer_impl)``: one memory and time
model per precision and optimizer implementation (``None``: the optimizer as given). The
implementation changes only the optimizer step's temporaries and time, which each model takes
from a plain trace with that implementation.

Note 5 (the floor). ``floor_candidates`` gives the least-memory configuration the models find at
each micro-batch size that can be least (Note 2: 1 and the whole batch), and beside each the same
with one mode in every block it changes (all recomputed, or all offloaded; the blocks it keeps stay
kept: e.g. the last block, whose backward follows its forward at once, so the models say changing it
saves nothing at the peak), and with that mode in every block outright (the trace may disagree: on
a tiny GPT-2 recomputing the last block too held 256 B less). The models can misjudge which is
least, so the caller re-traces them all and takes the least traced. Where that least turns out
far off (``api._floor``: replayed far above its bound), the caller asks for the other ways of
placing the training state (block weights on the host, gradients on the host, both on the
device; ``other_placements``): each one's least where that has one mode in every block, and
its least with recompute, then offload, in every block (one mode throughout: the twins compose
it, where a mix of modes is traced whole). The parameter-offload model, read off a trace
whose weights come and go, can be far too optimistic (llama-1b, 8 x 2 tokens on a GTX 1080 Ti:
its least predicted lowest, replayed at 11.11 GiB, where the gradients on the host are the
floor at 8.21 GiB and were no candidate).

Note 6 (levers beyond the per-block modes). A key may be longer: ``(precision, impl,
optimizer_state, offload_params)`` (``variant_key``), one model per low-bit optimizer state
(it changes only the optimizer's bytes) and per parameter offload (read off a trace with the
block weights on the host), and ``(precision, impl, optimizer_state, None, chunked_loss)`` for
the loss taken in pieces (read off a trace with it, beside each optimizer variant), and
``(precision, impl, None, None, None, True)`` for the optimizer stepped in backward (read off a
trace with it), and ``(precision, impl, None, None, None, None, True)`` for the gradients moved
to the host as backward makes them (``offload_gradients``, read off traces with it; the optimizer
state on the host only). A model says where its
optimizer state may live (``MemoryModel.placements``: bf16-pure and parameter offload each allow
one), which block modes it refuses (``excluded_modes``: parameter offload refuses activation
offload on the same blocks) and whether it runs the whole batch only (``whole_batch``: the
optimizer in backward steps as each gradient is made, so it cannot accumulate micro-batches);
the search and the floor respect all three. A caller's fixed ``optimizer_in_backward`` fixes
the micro-batch to the whole batch and the optimizer state to the device (``Constraints``).

Note 7 (a bound before the MILP). One mode per block makes each peak point separable: its least
value over every allowed ``x`` is its constant plus, per block, the least of its allowed
modes' coefficients. If that exceeds the cap at any point, no ``x`` fits and HiGHS is not
asked (proving a MILP infeasible is its slowest answer: 0.26 s a solve on Llama-2-7B's 32
blocks). The bound is necessary, not sufficient: where it passes the MILP decides.

Note 8 (a node limit, not a clock). Many identical blocks (Llama-2-7B's 32) make the MILP
symmetric: HiGHS finds the optimum within a few hundred branch-and-bound nodes and then may
spend tens of seconds proving it (41 s for one micro-batch size of one 7B layout). Each solve
is capped at ``NODE_LIMIT`` nodes, a count, so the answer does not depend on the machine's
speed or load; at the cap HiGHS's best incumbent is taken: it satisfies every constraint (it
fits), and on the 8 slowest instances of ``compare_gpus`` for Llama-2-7B its time equalled the
proven optimum in all 8 (at 200 nodes it was within 0.03%). Only where no incumbent exists at
the cap does the solve run to the end.

Note 9 (one mode where it costs nothing). The MILP's fastest mix often differs from one mode in
every block by a block or two kept (31 of 32 blocks offloaded), for a predicted step a fraction
of a percent faster. A mix is verified by a trace of the whole model; one mode in every block
composes from two shallow twins (docs/block-reuse.md), a quarter of the trace on Llama-3-8B
(about 6 s against 21 s). So where one of the mix's modes in every block also fits the cap,
and its predicted step is within ``NEAR_TIE`` of the mix's, the search answers it: a difference
that small is below what the time model resolves, and the uniform choice holds no more memory
than the mix (each block it changes gives up what keeping it held).

Note 10 (a bound on time). No mode is faster than keep (``TimeModel.mode_s`` of keep is 0, of
every other mode >= 0), so every block kept at a micro-batch size and optimizer placement is
the fastest anything there can be. Where that is no faster than the best choice found so far,
nothing there can replace it (a later choice must be strictly faster), and neither its rows
nor its MILP are built: the answer is the one the full search gives. The README's plan solved
85 MILPs before this bound.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from memfit.modes import Mode
from memfit.planner.choice import Choice, Constraints, unkey, variant_key
from memfit.planner.memory_model import MODES, MemoryModel
from memfit.planner.time_model import TimeModel

__all__ = ["search", "floor", "floor_candidates", "state_placement", "NEAR_TIE"]

_MIB = float(2 ** 20)
NODE_LIMIT = 1000          # branch-and-bound nodes per MILP (Note 8)
NEAR_TIE = 0.01            # a uniform choice this much slower than a mix is taken (Note 9)


def _bounds(model: MemoryModel, fixed: Constraints) -> tuple[np.ndarray, np.ndarray]:
    """Per variable lower/upper bounds: a mode a block cannot take, or the user's fixed mode."""
    nm = len(MODES)
    lo = np.zeros(len(model.blocks) * nm)
    hi = np.zeros(len(model.blocks) * nm)
    for i, name in enumerate(model.blocks):
        wanted = fixed.allowed(name)
        allowed = [m for m in model.allowed(i) if m in wanted]
        if not allowed:          # fixed to a mode the model cannot predict: kept as fixed
            allowed = list(wanted)
        for j, mode in enumerate(MODES):
            if mode in allowed:
                hi[i * nm + j] = 1.0
        if len(allowed) == 1:
            lo[i * nm + MODES.index(allowed[0])] = 1.0
    return lo, hi


def _solve(c: np.ndarray, A: np.ndarray, ub: np.ndarray, lo, hi, nblocks: int):
    nm = len(MODES)
    if nblocks == 0:
        return None
    cons = [LinearConstraint(_one_mode_per_block(nblocks, nblocks * nm), 1.0, 1.0)]
    if len(A):
        cons.append(LinearConstraint(A, -np.inf, ub))
    res = milp(c, constraints=cons, integrality=np.ones_like(c), bounds=Bounds(lo, hi),
               options={"node_limit": NODE_LIMIT})            # Note 8
    if res.x is None and res.status != 2:                     # no incumbent yet: solve it out
        res = milp(c, constraints=cons, integrality=np.ones_like(c), bounds=Bounds(lo, hi))
    if res.x is None:
        return None
    return np.round(res.x)


def _one_mode_per_block(nblocks: int, columns: int) -> np.ndarray:
    """Rows that sum each block's mode variables (block-major, ``MODES`` order): each == 1."""
    nm = len(MODES)
    rows = np.zeros((nblocks, columns))
    for i in range(nblocks):
        rows[i, i * nm:(i + 1) * nm] = 1.0
    return rows


def _modes_of(x: np.ndarray, nblocks: int) -> tuple[Mode, ...]:
    nm = len(MODES)
    return tuple(MODES[int(np.argmax(x[i * nm:(i + 1) * nm]))] for i in range(nblocks))


def _best_for(memory: MemoryModel, time: TimeModel, key, m: int, b: int,
              oo: bool, cap_bytes: float, fixed: Constraints) -> Choice | None | bool:
    """The fastest modes at (precision, m, oo) under ``cap_bytes`` allocated; ``False`` when
    even the least-memory modes do not fit (Note 2)."""
    nb, nm = len(memory.blocks), len(MODES)
    rows = memory.rows(m, b, accumulate=m < b, offload_optimizer=oo)
    lo, hi = _bounds(memory, fixed)
    n = -(-b // m)
    cost = np.array([time.mode_s(i, mode, m, n, b) for i in range(nb) for mode in MODES])
    keep = np.zeros(nb * nm)
    keep[[i * nm for i in range(nb)]] = 1.0
    if fixed.keep_allowed(memory.blocks) and rows.peak(keep) <= cap_bytes:
        x = keep
    elif _lower_bound(rows, hi, nb) > cap_bytes:      # Note 7: no MILP can fit
        return False
    else:
        x = _solve(cost * 1e3, rows.A / _MIB, (cap_bytes - rows.const) / _MIB, lo, hi, nb)
        if x is None:
            return False
        if rows.peak(x) > cap_bytes * (1 + 1e-9):      # rounding of a near-integral answer
            return False
    return _choice(memory, time, key, m, b, oo, rows.peak(x), _modes_of(x, nb))


def _keep_s(memory: MemoryModel, time: TimeModel, m: int, b: int, oo: bool) -> float:
    """The predicted step with every block kept at (m, oo): no choice there is faster (Note
    10)."""
    return time.step_s(m, b, (Mode.KEEP,) * len(memory.blocks), oo)


def _lower_bound(rows, hi: np.ndarray, nblocks: int) -> float:
    """The least any one-hot ``x`` within ``hi`` can make the highest peak point (Note 7)."""
    if nblocks == 0 or not len(rows.A):
        return float(np.max(rows.const, initial=-np.inf))
    nm = len(MODES)
    A = np.where(hi.reshape(1, nblocks, nm) > 0, rows.A.reshape(len(rows.A), nblocks, nm),
                 np.inf)
    return float(np.max(rows.const + A.min(axis=2).sum(axis=1)))


def _choice(memory, time, key, m, b, oo, allocated, modes) -> Choice:
    precision, impl, state, params, chunked, in_backward, grads = unkey(key)
    return Choice(precision, m, modes, oo, int(allocated), memory.device_bytes(allocated),
                  time.step_s(m, b, modes, oo), impl, state, params, chunked, in_backward, grads)


def _host_stepped_variant(models, key, oo: bool) -> bool:
    """An optimizer on the host steps as given: another implementation changes nothing there
    (and its re-trace would differ only by its bookkeeping), so only the given one is tried."""
    return oo and key[1] is not None and variant_key(key[0], None, *unkey(key)[2:]) in models


def _placements(memory: MemoryModel, fixed: Constraints) -> list[bool]:
    """Where the optimizer state may live for this model (Note 6) and the caller."""
    allowed = getattr(memory, "placements", (False, True))
    if fixed.offload_optimizer is not None:
        return [fixed.offload_optimizer] if fixed.offload_optimizer in allowed else []
    return list(allowed)


def search(models: dict[tuple, tuple[MemoryModel, TimeModel]], b: int, budget_bytes: int,
           fixed: Constraints = Constraints(), margins: dict[tuple, int] | None = None
           ) -> Choice | None:
    """The fastest ``Choice`` predicted to fit ``budget_bytes`` device bytes (Note 1), or None.
    ``margins``: per ``models`` key, bytes to take off the cap (what verification found
    missing)."""
    best = None
    for key, (memory, time) in models.items():
        cap_device = budget_bytes - memory.context_bytes - (margins or {}).get(key, 0)
        cap = cap_device / memory.device_ratio
        sizes = [min(fixed.micro_batch_size, b)] if fixed.micro_batch_size \
            else list(range(1, b + 1))
        sizes = _sizes_of(memory, sizes, b)
        for oo in _placements(memory, fixed):
            if _host_stepped_variant(models, key, oo):
                continue
            for m in sizes:
                if best is not None and _keep_s(memory, time, m, b, oo) >= best.step_s:
                    continue      # Note 10: nothing at (key, m, oo) is faster than best
                found = _best_for(memory, time, key, m, b, oo, cap, fixed)
                if found is False and m < b and b in sizes:     # Note 2: only m = b is left
                    found = _best_for(memory, time, key, b, b, oo, cap, fixed)
                if found is False:
                    break
                if best is None or found.step_s < best.step_s:
                    best = found
                if found.micro_batch_size == b:
                    break
    return _one_mode(best, models, b, budget_bytes, fixed, margins)


def _one_mode(best: Choice | None, models, b: int, budget_bytes: int, fixed: Constraints,
              margins: dict[tuple, int] | None) -> Choice | None:
    """``best``, or one of its modes in every block where that fits and is within ``NEAR_TIE``
    of its predicted step (Note 9)."""
    if best is None or len(set(best.modes)) < 2:
        return best
    memory, time = models[best.key]
    cap = (budget_bytes - memory.context_bytes - (margins or {}).get(best.key, 0)) / \
        memory.device_ratio
    out = best
    for mode in sorted(set(best.modes) - {Mode.KEEP}, key=MODES.index):
        u = _uniform(memory, time, best, mode, b, fixed, every=True)
        if u is None or len(set(u.modes)) > 1 or u.allocated_bytes > cap or \
                u.step_s > best.step_s * (1 + NEAR_TIE):
            continue
        if out is best or u.step_s < out.step_s:
            out = dataclasses.replace(u, mix_step_s=best.step_s)
    return out


def _sizes_of(memory: MemoryModel, sizes: list[int], b: int) -> list[int]:
    """The micro-batch sizes this model may take (Note 6: the whole batch only, or any)."""
    return [m for m in sizes if m == b] if getattr(memory, "whole_batch", False) else sizes


def _sizes_for_floor(b: int, fixed: Constraints) -> list[int]:
    return [min(fixed.micro_batch_size, b)] if fixed.micro_batch_size else sorted({1, b})


def _least_at(memory: MemoryModel, time: TimeModel, key, m: int, b: int, oo: bool,
              fixed: Constraints) -> Choice:
    """The modes with the fewest predicted bytes at (key, m, oo): minimise z subject to
    const + A x <= z (bytes in MiB)."""
    nb, nm = len(memory.blocks), len(MODES)
    rows = memory.rows(m, b, accumulate=m < b, offload_optimizer=oo)
    if nb == 0:
        return _choice(memory, time, key, m, b, oo, rows.peak(np.zeros(0)), ())
    lo, hi = _bounds(memory, fixed)
    c = np.zeros(nb * nm + 1)
    c[-1] = 1.0
    A = np.hstack([rows.A / _MIB, -np.ones((len(rows.const), 1))])
    one_hot = _one_mode_per_block(nb, nb * nm + 1)
    integrality = np.r_[np.ones(nb * nm), 0.0]
    res = milp(c, constraints=[LinearConstraint(one_hot, 1.0, 1.0),
                               LinearConstraint(A, -np.inf, -rows.const / _MIB)],
               integrality=integrality,
               bounds=Bounds(np.r_[lo, -np.inf], np.r_[hi, np.inf]))
    x = np.round(res.x[:-1])
    return _choice(memory, time, key, m, b, oo, rows.peak(x), _modes_of(x, nb))


def _uniform(memory: MemoryModel, time: TimeModel, like: Choice, mode: Mode, b: int,
             fixed: Constraints, every: bool = False) -> Choice | None:
    """``like`` with ``mode`` in every block it does not keep (``every``: in every block),
    where allowed (Note 5); None if no block may take it."""
    modes = tuple(mode if (every or old != Mode.KEEP) and mode in fixed.allowed(n)
                  and mode in memory.allowed(i) else old
                  for i, (n, old) in enumerate(zip(memory.blocks, like.modes)))
    if mode not in modes:
        return None
    m, oo = like.micro_batch_size, like.offload_optimizer
    nm = len(MODES)
    x = np.zeros(len(modes) * nm)
    x[[i * nm + MODES.index(md) for i, md in enumerate(modes)]] = 1.0
    rows = memory.rows(m, b, accumulate=m < b, offload_optimizer=oo)
    return _choice(memory, time, like.key, m, b, oo, rows.peak(x), modes)


def floor(models: dict[tuple, tuple[MemoryModel, TimeModel]], b: int,
          fixed: Constraints = Constraints()) -> Choice:
    """The configuration with the fewest predicted device bytes anywhere in the space."""
    return min(floor_candidates(models, b, fixed), key=lambda c: c.device_bytes)


def state_placement(key: tuple) -> str:
    """Where a model's key puts the training state (Note 5): the block weights on the host, the
    gradients on the host, or both on the device."""
    full = unkey(key)
    return "weights on the host" if full[3] else "gradients on the host" if full[6] else \
        "on the device"


def floor_candidates(models: dict[tuple, tuple[MemoryModel, TimeModel]], b: int,
                     fixed: Constraints = Constraints(), *, other_placements: bool = False
                     ) -> list[Choice]:
    """What may be the least-memory configuration (Note 5), fewest predicted bytes first;
    ``other_placements``: instead, the one-mode configurations of each way of placing the
    training state but the least's (Note 5)."""
    out: list[Choice] = []
    for m in _sizes_for_floor(b, fixed):
        per_family: dict[str, Choice] = {}      # per way the state is placed (Note 5)
        for key, (memory, time) in models.items():
            if not _sizes_of(memory, [m], b):
                continue
            for oo in reversed(_placements(memory, fixed)):
                if _host_stepped_variant(models, key, oo):
                    continue
                c = _least_at(memory, time, key, m, b, oo, fixed)
                family = state_placement(key)
                if family not in per_family or c.device_bytes < per_family[family].device_bytes:
                    per_family[family] = c
        if not per_family:
            continue
        least = min(per_family.values(), key=lambda c: c.device_bytes)
        if not other_placements:
            memory, time = models[least.key]
            out.append(least)
            for mode, every in itertools.product((Mode.RECOMPUTE, Mode.OFFLOAD), (False, True)):
                u = _uniform(memory, time, least, mode, b, fixed, every)
                if u is not None and u.modes != least.modes and u not in out:
                    out.append(u)
            continue
        for c in per_family.values():   # one mode throughout: twins compose it
            if state_placement(c.key) == state_placement(least.key):
                continue
            memory, time = models[c.key]
            uniform = [c] if len(set(c.modes)) == 1 else []
            for mode in (Mode.RECOMPUTE, Mode.OFFLOAD):
                uniform.append(_uniform(memory, time, c, mode, b, fixed, every=True))
            out += [u for u in uniform if u is not None and u not in out]
    return sorted(out, key=lambda c: c.device_bytes)
