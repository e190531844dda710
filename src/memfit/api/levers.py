"""The config levers of SEED.md Answer 2: the largest sequence length or batch that fits
(``largest_fitting``), a what-if table over sequence length, hidden size and layer count
(``what_if``, in ``_whatif``), and a progressive sequence-length schedule (``progressive``, in
``_progressive``).

Note 1 (what "the largest value that fits" means). memfit's own knobs can shrink a step a long
way, so the question is asked of memfit's least-memory configuration: the knobs the caller
fixed are kept, the free ones take their least-memory choice: ``checkpoint="all"``,
``offload_optimizer=True`` (not under bf16-pure, which refuses it), and
- for ``lever="seq_len"``: ``micro_batch_size=1`` (accumulation over the whole batch): the
  longest input any plan could train at this batch size;
- for ``lever="batch_size"``: the batch must fit in ONE micro-batch (``micro_batch_size`` = the
  batch). With accumulation any batch fits (only its input tensors grow), so the useful number
  is the largest batch one forward/backward can hold. A fixed ``micro_batch_size`` contradicts
  that definition and is refused.
The value is then a bound: ``memfit.plan`` at that value finds the fastest plan that fits.

Note 2 (search). Memory grows with both levers, so a binary search finds the boundary. The
range: seq_len from 1 (2 for causal LMs) to the model's position limit
(``zoo._batches.position_limit``: ``max_position_embeddings`` less the padding offset of
RoBERTa-like models, so XLM-R's 514 positions hold 512 tokens; doubling up to 65536 where
positions are unlimited); batch_size by doubling from the given batch up to 65536, then
bisecting. Probes trace with ``allocator_replay=False`` (one step, allocated bytes only); the
answer is then confirmed with the allocator replayed (CUDA targets; a CPU probe is already
exact). If the confirmation does not fit (the allocator's rounding and the CUDA context are
what the probes leave out), the difference it showed is added to the fast probes to find a
candidate below, and confirmations bisect between the candidate and the failed value (or
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

from memfit.api._progressive import Phase, ProgressiveSchedule, progressive
from memfit.api._setup import resolve_device, resolve_precision
from memfit.api._whatif import WhatIfRow, what_if
from memfit.api.estimate import estimate
from memfit.errors import BudgetTooSmall
from memfit.knobs import Knobs
from memfit.units import format_bytes, parse_bytes
from memfit.zoo._batches import position_limit

__all__ = ["Largest", "largest_fitting", "WhatIfRow", "what_if", "Phase", "ProgressiveSchedule",
           "progressive"]

LEVERS = ("seq_len", "batch_size")
_MAX_BATCH = 65536
_MAX_UNLIMITED_SEQ = 65536


@dataclass(frozen=True)
class Largest:
    """The largest value of one lever that fits memfit's least-memory configuration (Note 1)."""

    lever: str                 # "seq_len" | "batch_size"
    value: int                 # tokens per sample, or samples per (single) micro-batch
    device_bytes: int          # what the step holds on the device at ``value`` (confirmed)
    limit_bytes: int           # the budget, else the device's usable memory
    knobs: dict = field(hash=False)   # the knobs probed (non-None Knobs fields)
    probes: int                # estimates traced, the confirmation(s) included
    capped_by: str | None = None      # set when ``value`` is the search's upper bound, not memory


def least_memory_knobs(lever: str, batch_size: int, spec, knobs: dict) -> dict:
    """The caller's knobs, the free ones set to their least-memory choice (Note 1)."""
    k = Knobs.from_kwargs(**knobs)
    k.check_available()
    if lever == "batch_size" and k.micro_batch_size is not None:
        raise ValueError(
            f"micro_batch_size={k.micro_batch_size} was fixed, but the largest batch_size is "
            "defined as the largest batch ONE micro-batch holds (with accumulation any batch "
            "fits): drop micro_batch_size, or search lever='seq_len'")
    k = k.replace(precision=resolve_precision(k.precision, spec))
    free = {"checkpoint": "all", "micro_batch_size": 1 if lever == "seq_len" else batch_size}
    if k.precision != "bf16-pure":
        free["offload_optimizer"] = True
    values = {n: v for n, v in k.to_dict().items() if v is not None}
    return {**free, **values}


def largest_fitting(spec, model, lever: str, *, batch_size: int, seq_len: int | None,
                    budget=None, device=None, optimizer="adamw", task=None,
                    on_progress: Callable[[str], None] | None = None, **knobs) -> Largest:
    """The largest ``seq_len`` or ``batch_size`` for which one training step of ``model``
    (built from the zoo ``spec``) fits ``budget`` (default: the device's usable memory) under
    memfit's least-memory configuration (Note 1). ``seq_len`` is the sequence length when the
    lever is the batch size (ignored for ``lever="seq_len"``); ``batch_size`` is the batch when
    the lever is the sequence length (and where the doubling starts for ``"batch_size"``).
    Raises ``memfit.BudgetTooSmall`` when even the smallest value does not fit."""
    if lever not in LEVERS:
        raise ValueError(f"lever={lever!r}: use one of {', '.join(LEVERS)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    say = on_progress or (lambda message: None)
    dev = resolve_device(model, device)
    limit = parse_bytes(budget) if budget is not None else dev.usable_bytes
    task = spec.check_task(task) if task is not None else None
    prober = _Prober(spec, model, lever, batch_size, seq_len, task, dev, limit, optimizer,
                     knobs, say)
    low, top, why = prober.range()
    value = _search(prober.fast, prober.limit, low, top)
    if value >= low:
        say(f"confirming {lever}={value} with the allocator replayed")
        confirmed = prober.confirm(value)
        if confirmed > limit:                                        # Note 2
            value = _search_below(prober, low, value, confirmed - prober.fast(value))
        if value >= low:
            return Largest(lever, value, prober.confirm(value), limit,
                           dict(prober.knobs(value)), prober.count,
                           why if value == top else None)
    floor = prober.confirm(low)
    raise BudgetTooSmall(
        f"even {lever}={low} needs {format_bytes(floor)} on the {dev.display_name} under "
        f"memfit's least-memory configuration ({_describe(prober.knobs(low))}); the limit is "
        f"{format_bytes(limit)}. Lower the other lever (batch size or sequence length), use a "
        "smaller model, or raise the budget", floor_bytes=floor, budget_bytes=limit)


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
                 knobs, say):
        self.spec, self.model, self.lever, self.task = spec, model, lever, task
        self.batch_size, self.seq_len = batch_size, seq_len
        self.dev, self.limit, self.optimizer, self.say = dev, limit, optimizer, say
        self.user_knobs = knobs
        least_memory_knobs(lever, batch_size, dev, knobs)      # validate before any trace
        self.count = 0
        self._fast: dict[int, int] = {}
        self._slope: dict[int, int] = {}
        self._confirmed: dict[int, int] = {}

    def range(self) -> tuple[int, int, str]:
        config = self.model.config
        if self.lever == "batch_size":
            return 1, self._doubling_cap(), f"the search's ceiling of {_MAX_BATCH} samples"
        task = self.task or self.spec._task_of(self.model) or self.spec.default_task
        low = 2 if task == "causal-lm" else 1
        limit, why = position_limit(config)
        if limit is None:
            return low, self._doubling_cap(), f"the search's ceiling of {_MAX_UNLIMITED_SEQ} tokens"
        return low, limit, f"the model's position limit ({why})"

    def _doubling_cap(self) -> int:
        """Double from the given value until a probe does not fit; the bisection's ceiling."""
        top = _MAX_BATCH if self.lever == "batch_size" else _MAX_UNLIMITED_SEQ
        v = max(1, self.batch_size if self.lever == "batch_size" else (self.seq_len or 256))
        while v < top and self.fast(v) <= self.limit:
            v *= 2
        return min(v, top)

    def knobs(self, v: int) -> dict:
        b = v if self.lever == "batch_size" else self.batch_size
        return least_memory_knobs(self.lever, b, self.dev, self.user_knobs)

    def _batch(self, v: int, samples: int | None = None):
        b = v if self.lever == "batch_size" else self.batch_size
        L = v if self.lever == "seq_len" else self.seq_len
        return self.spec.make_batch(self.model, samples or b, seq_len=L, task=self.task)

    def _trace(self, v: int, samples: int | None, replay: bool) -> int:
        self.count += 1
        est = estimate(self.model, self._batch(v, samples), self.optimizer, self.dev,
                       budget=self.limit, allocator_replay=replay, **self.knobs(v))
        return est.device_bytes

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


def _describe(knobs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in knobs.items())

