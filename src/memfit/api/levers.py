"""The config levers of SEED.md Answer 2 that ``plan`` answers: the largest sequence length or
batch at which a plan fits (``largest_fitting``: ``--seq-len auto`` / ``--batch-size auto``).
The what-if table and the progressive schedule are studies on top of the planner
(``memfit.studies``).

Note 1 (what "the largest value that fits" means). The largest value at which ``memfit.plan``
finds a plan (issue 27: the answer and ``plan`` must agree): every lever the plan has counts
(precision, micro-batches, per-block recompute / offload, the optimizer state on the host or in
low bits, the block weights on the host, the allocator setting), and the knobs the caller fixed
are kept.
- for ``lever="seq_len"``: the longest input any plan could train at this batch size;
- for ``lever="batch_size"``: the batch must fit in ONE micro-batch (``micro_batch_size`` = the
  batch). With accumulation any batch fits (only its input tensors grow), so the useful number
  is the largest batch one forward/backward can hold. A fixed ``micro_batch_size`` contradicts
  that definition and is refused.
How: the plan's floor at the smallest value (``plan_traced(floor=True)``) names the least-memory
configuration; the bisection (Note 2) probes that configuration at each value, cheaply. The least
configuration at a short input is not the least at a long one (at 2 tokens fp32 may hold less
than fp16 autocast's weight copies; at 1 token one micro-batch may beat accumulation), so the
floor is traced again at the probes' answer and, where its configuration differs, the probes run
again with it (``_RELEARN`` times at most). The answer is then checked by ``plan`` itself: it
must plan at the answer and refuse one past it; where it does not agree, ``plan`` is the probe
that gallops and bisects the rest of the way. The smallest value's floor over the limit refuses the
job with ``BudgetTooSmall`` (nothing any plan does fits).

Note 2 (search). Memory grows with both levers, so a binary search finds the boundary. The
range: seq_len from 1 (2 for causal LMs) to the model's position limit
(``zoo._batches.position_limit``: ``max_position_embeddings`` less the padding offset of
RoBERTa-like models, so XLM-R's 514 positions hold 512 tokens; doubling up to 65536 where
positions are unlimited); batch_size by doubling from the given batch up to 65536, then
bisecting. Probes trace with ``allocator_replay=False`` (one step, allocated bytes only), to
which the card's fixed bytes are added (its workspaces and CUDA context, ``trace.card``; left
out, a 2-block model under 700 MiB on an RTX 4090, whose context is 620 MiB of it, probed
1,365 samples where 76 fit); the answer is then confirmed with the allocator replayed (CUDA
targets; a CPU probe is already exact). If the confirmation does not fit (the allocator's
rounding is what the probes leave out), the difference it showed is added to the fast probes
to find a candidate below, and confirmations bisect between the candidate and the failed value (or
below the candidate, if it fails too). Device bytes on a GPU move in allocator segments, so
they are monotone steps, not a line: the bisection by confirmations is what makes the answer
exact, the fast probes only make it cheap.

Note 3 (accumulated probes). Tracing micro-batch 1 over a batch of 32 traces 32 forward and
backward passes. All micro-batches past the first see the same live state (the gradients
exist, the batch's tensors are live), so the peak of n >= 3 full micro-batches of ``m`` is
linear in the samples: ``d(n*m) = d(2m) + (n-2) * (d(3m) - d(2m))`` (the slope is the batch's
own tensors plus per-sample bookkeeping). Probes with 4 or more full micro-batches trace 2m and
3m samples and extrapolate; on a CPU the tests hold this to the byte against the full trace.
The confirmation replays the allocator on 2m samples and adds the same linear term (an upper
bound: the allocator may place those few bytes in segments it already holds); where that bound
is over the limit but the 2m replay is not, the whole batch is replayed to settle it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from memfit.api._plan_allocator import AllocatorChoice
from memfit.api._setup import resolve_device
from memfit.api._stages import Stages
from memfit.api.estimate import estimate
from memfit.api.plan import plan_traced
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.trace.card import fixed_bytes
from memfit.units import parse_bytes
from memfit.zoo._batches import position_limit

__all__ = ["Largest", "largest_fitting"]

LEVERS = ("seq_len", "batch_size")
_MAX_BATCH = 65536
_MAX_UNLIMITED_SEQ = 65536
_RELEARN = 2          # floors re-traced at the probes' answer (Note 1)


@dataclass(frozen=True)
class Largest:
    """The largest value of one lever at which ``memfit.plan`` finds a plan (Note 1); ``knobs``
    and ``device_bytes`` are that plan's (``planned``: it, with its traces)."""

    lever: str                 # "seq_len" | "batch_size"
    value: int                 # tokens per sample, or samples per (single) micro-batch
    device_bytes: int          # what the step holds on the device at ``value`` (confirmed)
    limit_bytes: int           # the budget, else the device's usable memory
    knobs: dict = field(hash=False)   # the knobs probed (non-None Knobs fields)
    probes: int                # estimates and plans traced, the confirmation(s) included
    capped_by: str | None = None      # set when ``value`` is the search's upper bound, not memory
    planned: object = field(default=None, hash=False, compare=False, repr=False)  # plan at value


def largest_fitting(spec, model, lever: str, *, batch_size: int, seq_len: int | None,
                    budget=None, device=None, optimizer="adamw", task=None,
                    on_progress: Callable[[str], None] | None = None,
                    allow_numerics_change: bool | None = None, **knobs) -> Largest:
    """The largest ``seq_len`` or ``batch_size`` at which ``memfit.plan`` fits one training step
    of ``model`` (built from the zoo ``spec``) in ``budget`` (default: the device's usable
    memory), every lever of the plan counted (Note 1). ``seq_len`` is the sequence length when
    the lever is the batch size (ignored for ``lever="seq_len"``); ``batch_size`` is the batch
    when the lever is the sequence length (and where the doubling starts for ``"batch_size"``).
    ``allow_numerics_change``: as ``memfit.plan`` takes it.
    Raises ``memfit.BudgetTooSmall`` when even the smallest value does not fit."""
    if lever not in LEVERS:
        raise ValueError(f"lever={lever!r}: use one of {', '.join(LEVERS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    say = Stages(on_progress)       # numbered; a bisection expects no count (api._stages)
    dev = resolve_device(model, device)
    if allow_numerics_change is not None:
        knobs["allow_numerics_change"] = allow_numerics_change
    limit = parse_bytes(budget) if budget is not None else dev.usable_bytes
    task = spec.check_task(task) if task is not None else None
    prober = _Prober(spec, model, lever, batch_size, seq_len, task, dev, limit, optimizer,
                     knobs, say, budget=budget)
    low = prober.low()
    prober.learn(low)                       # the least-memory configuration, or BudgetTooSmall
    top, why = prober.top()
    value = _probed(prober, low, top)
    for _ in range(_RELEARN):               # the floor's configuration where the answer is
        if value <= low or not prober.learn(value):
            break
        value = _probed(prober, low, top)
    value, planned = _agree(prober, max(value, low), low, top)      # Note 1: plan decides
    return Largest(lever, value, planned.plan.predicted_device_bytes, limit,
                   {n: v for n, v in planned.plan.knobs.to_dict().items() if v is not None},
                   prober.count, why if value == top else None, planned)


def _probed(prober, low: int, top: int) -> int:
    """The largest value the probed configuration fits, confirmed (Note 2), else low - 1."""
    value = _search(prober.fast, prober.limit, low, top)
    if value >= low:
        prober.say(f"confirming {prober.lever}={value} with the allocator replayed")
        confirmed = prober.confirm(value)
        if confirmed > prober.limit:
            value = _search_below(prober, low, value, confirmed - prober.fast(value))
    return value


def _agree(prober, value: int, low: int, top: int):
    """``(v, plan at v)``: the largest v at which ``plan`` plans, from the probes' ``value``
    (Note 1): checked there and one past it, bisected by ``plan`` where either disagrees."""
    planned = prober.plan(value)
    if planned is None:                      # the probes were optimistic: bisect below
        good, bad, found = low, value, prober.plan(low)
        if found is None:       # the traced floor fit at low, plan refuses it: plan decides
            prober.refuse(low)
    elif value >= top or prober.plan(value + 1) is None:
        return value, planned
    else:                                    # a longer value plans too: gallop, then bisect
        good, found, step = value + 1, prober.plan(value + 1), 2
        while good + step <= top and prober.plan(good + step) is not None:
            good, found, step = good + step, prober.plan(good + step), step * 2
        bad = min(good + step, top + 1)
    while bad - good > 1:
        mid = (good + bad) // 2
        at = prober.plan(mid)
        good, bad, found = (mid, bad, at) if at is not None else (good, mid, found)
    return good, found


def _search(probe: Callable[[int], int], limit: int, low: int, cap: int) -> int:
    """The largest value in [low, cap] whose ``probe`` fits ``limit``, else low - 1."""
    def fits(v: int) -> bool:
        return probe(v) <= limit

    if cap < low:
        return low - 1
    if fits(cap):
        return cap
    if not fits(low):
        return low - 1
    good, bad = low, cap                        # fits(good), not fits(bad)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _search_below(prober, low: int, failed: int, overhead: int) -> int:
    """After ``failed`` did not confirm: the fast probes plus the ``overhead`` the confirmation
    showed give a candidate; confirmations bisect between it and ``failed`` (Note 2)."""
    candidate = _search(lambda v: prober.fast(v) + overhead, prober.limit, low, failed - 1)
    candidate = max(candidate, low)
    prober.say(f"confirming {prober.lever}={candidate} with the allocator replayed")
    if prober.confirm(candidate) <= prober.limit:
        good, bad = candidate, failed
    elif candidate == low or prober.confirm(low) > prober.limit:
        return low - 1
    else:
        good, bad = low, candidate
    while bad - good > 1:
        mid = (good + bad) // 2
        prober.say(f"confirming {prober.lever}={mid} with the allocator replayed")
        good, bad = (mid, bad) if prober.confirm(mid) <= prober.limit else (good, mid)
    return good


class _Prober:
    """Builds the batch at a value, traces it (memoised) and counts the traces."""

    def __init__(self, spec, model, lever, batch_size, seq_len, task, dev, limit, optimizer,
                 knobs, say, budget=None):
        self.spec, self.model, self.lever, self.task = spec, model, lever, task
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dev, self.limit, self.optimizer, self.say = dev, limit, optimizer, say
        self.budget = limit if budget is None else budget     # as the caller gave it
        self.user_knobs = knobs
        k = Knobs.from_kwargs(**{n: v for n, v in knobs.items()     # validate before any trace
                                 if n != "allow_numerics_change"})
        k.check_available()
        if lever == "batch_size" and k.micro_batch_size is not None:
            raise ValueError(
                f"micro_batch_size={k.micro_batch_size} was fixed, but the largest batch_size is "
                "defined as the largest batch ONE micro-batch holds (with accumulation any batch "
                "fits): drop micro_batch_size, or search lever='seq_len'")
        self._least: dict = {}
        self._alloc = AllocatorChoice(model, dev, None)
        self._plans: dict = {}
        self.count = 0
        self._fast: dict[int, int] = {}
        self._slope: dict[int, int] = {}
        self._confirmed: dict[int, int] = {}

    def low(self) -> int:
        """The smallest value searched: 1, or 2 tokens for a causal LM (a shifted label)."""
        if self.lever == "batch_size":
            return 1
        task = self.task or self.spec._task_of(self.model) or self.spec.default_task
        return 2 if task == "causal-lm" else 1

    def top(self) -> tuple[int, str]:
        """The bisection's ceiling, and why it is one."""
        if self.lever == "batch_size":
            return self._doubling_cap(), f"the search's ceiling of {_MAX_BATCH} samples"
        limit, why = position_limit(self.model.config)
        if limit is None:
            return self._doubling_cap(), f"the search's ceiling of {_MAX_UNLIMITED_SEQ} tokens"
        return limit, f"the model's position limit ({why})"

    def _fixed(self, v: int) -> dict:
        """The caller's knobs at ``v``: the batch lever's one micro-batch (Note 1)."""
        if self.lever == "batch_size":
            return {**self.user_knobs, "micro_batch_size": v}
        return dict(self.user_knobs)

    def learn(self, v: int) -> bool:
        """The plan's floor at ``v`` names the least-memory configuration the probes trace
        (Note 1); whether it changed. The first call (the smallest value) raises
        ``BudgetTooSmall`` where even ``v`` does not fit."""
        found: dict = {}
        self.say(f"finding the least-memory configuration at {self.lever}={v}")
        try:
            self._plan_at(v, floor=True, on_floor=found.update)
        except BudgetTooSmall as e:
            if not self._least:
                raise BudgetTooSmall(
                    f"even {self.lever}={v} does not fit: {e}", floor_bytes=e.floor_bytes,
                    budget_bytes=self.limit) from None
        if found == self._least or not found:
            return False
        self._least = found
        self._fast.clear()
        self._slope.clear()
        self._confirmed.clear()
        return True

    def knobs(self, v: int) -> dict:
        """The least-memory configuration (``learn``) at ``v``."""
        least = dict(self._least)
        if self.lever == "batch_size":
            least["micro_batch_size"] = v
        return least

    def _plan_at(self, v: int, **extra):
        self.count += 1
        return plan_traced(self.model, self._batch(v), self.budget, self.optimizer, self.dev,
                           suggest_shorter=False, **extra, **self._fixed(v))

    def refuse(self, v: int) -> None:
        """``plan``'s own refusal at ``v`` (Note 1: plan decides, where a traced floor fit and
        plan's bound from the parameters alone does not), as ``learn`` words one."""
        try:
            self._plan_at(v)
        except BudgetTooSmall as e:
            raise BudgetTooSmall(f"even {self.lever}={v} does not fit: {e}",
                                 floor_bytes=e.floor_bytes, budget_bytes=self.limit) from None
        raise AssertionError(f"plan at {self.lever}={v} refused, then planned")

    def plan(self, v: int):
        """``plan`` at ``v`` (memoised), or None where it refuses."""
        if v not in self._plans:
            self.say(f"planning at {self.lever}={v}")
            try:
                self._plans[v] = self._plan_at(v)
            except BudgetTooSmall:
                self._plans[v] = None
        return self._plans[v]

    def _doubling_cap(self) -> int:
        """Double from the given value until a probe does not fit; the bisection's ceiling."""
        top = _MAX_BATCH if self.lever == "batch_size" else _MAX_UNLIMITED_SEQ
        v = max(1, self.batch_size if self.lever == "batch_size" else (self.seq_len or 256))
        while v < top and self.fast(v) <= self.limit:
            v *= 2
        return min(v, top)

    def _batch(self, v: int, samples: int | None = None):
        b = v if self.lever == "batch_size" else self.batch_size
        L = v if self.lever == "seq_len" else self.seq_len
        return self.spec.make_batch(self.model, samples or b, seq_len=L, task=self.task)

    def _trace(self, v: int, samples: int | None, replay: bool) -> int:
        self.count += 1
        est = estimate(self.model, self._batch(v, samples), self.optimizer, self.dev,
                       budget=self.limit, allocator_replay=replay, **self.knobs(v))
        if not replay:        # allocated bytes only: the card's fixed bytes added (Note 2)
            return est.device_bytes + sum(fixed_bytes(self.dev, est.op_log))
        # replayed: under the allocator setting a plan would choose, as the plan counts it
        return est.device_bytes - self._alloc.saved(est)

    def _split(self, v: int) -> tuple[int, int] | None:
        """(micro-batch, full micro-batches) when Note 3's extrapolation applies, else None."""
        k = self.knobs(v)
        b = v if self.lever == "batch_size" else self.batch_size
        m = k["micro_batch_size"]
        return (m, b // m) if m < b and b % m == 0 and b // m >= 4 else None

    def fast(self, v: int) -> int:
        """Device bytes at ``v`` without the allocator replay (Note 3 where it applies)."""
        if v not in self._fast:
            self.say(f"probing {self.lever}={v}")
            split = self._split(v)
            if split is None:
                self._fast[v] = self._trace(v, None, False)
            else:
                m, n = split
                two, three = self._trace(v, 2 * m, False), self._trace(v, 3 * m, False)
                self._slope[v] = three - two
                self._fast[v] = two + (n - 2) * (three - two)
        return self._fast[v]

    def confirm(self, v: int) -> int:
        """Device bytes at ``v`` with the allocator replayed (equal to ``fast`` on a CPU)."""
        fast = self.fast(v)
        if self.dev.kind != "cuda":
            return fast
        if v not in self._confirmed:
            self._confirmed[v] = self._replayed(v)
        return self._confirmed[v]

    def _replayed(self, v: int) -> int:
        """Note 3: 2m samples replayed, plus the linear term where that bound settles the
        question; the whole batch replayed where it does not."""
        split = self._split(v)
        if split is not None:
            m, n = split
            two = self._trace(v, 2 * m, True)
            bound = two + (n - 2) * self._slope[v]
            if two > self.limit or bound <= self.limit:
                return two if two > self.limit else bound
        return self._trace(v, None, True)
