"""Interleaved step timing, shared by every benchmark that compares settings' step times.

    timings = interleave({"plain": plain_step, CONTROL: plain_again, "ckpt": ckpt_step},
                         rounds=5, baseline="plain")
    timings.ratio("ckpt")          # Ratio(median=1.31, low=1.27, high=1.36, rounds=5)

Note 1 (why interleave). The benchmark machines are shared: their speed moves by 2-5x over
seconds as other jobs come and go. Settings timed one after another each meet a different
machine (plain against plain read 0.95x that way). Here every round runs every setting once, so
a slow phase lands on every setting alike, and each setting's ratio is taken against the
baseline *in the same round* before the median over rounds is kept.

Note 2 (the order). The rounds are the rows of a balanced Latin square (Williams): round ``r``
runs ``(w[i] + r) % n`` for the sequence ``w = 0, 1, n-1, 2, n-2, ...`` (with ``n`` odd, the
next ``n`` rounds run those rows backwards). Over ``n`` rounds (``2n`` when ``n`` is odd) every
setting takes every position equally often and follows every other setting equally often, so
none always runs right after a particular one (inheriting its freed memory or warm caches) and
none always runs first. A plain rotation would not do it: there ``k + 1`` always follows ``k``.
``order="shuffle"`` draws a seeded permutation per round instead.

Note 3 (the control). The caller adds a second copy of the baseline, built the same way, under
``CONTROL``: its ratio should read 1.00x, and how far it reads from it is the noise left in
every other ratio. ``Ratio.low``/``high`` are the quartiles of the per-round ratios (the spread).

Note 4 (what is timed). A step is a zero-argument callable; its wall time is ``clock()`` after
``sync()`` minus ``clock()`` before it (``sync``: ``torch.cuda.synchronize`` on a GPU, so the
kernels a step queued are inside its time). Warm-up steps (not timed) run first, in the first
round's order. Beside the wall time, the process's CPU time (``cpu_clock``, default
``time.process_time``) of each step is kept: on a CPU with one torch thread it is the step's
work without the time spent waiting for a core that other jobs hold, so its ratios are far
steadier on an oversubscribed machine (``ratio(..., clock="cpu")``). With more threads it
also counts OpenMP's spin-waits, and on a GPU it means nothing: read the wall ratios there.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["CONTROL", "Ratio", "Timings", "interleave", "schedule"]

CONTROL = "plain (control)"


def schedule(n: int, rounds: int, order: str = "balanced", seed: int = 0) -> list[list[int]]:
    """The order of ``n`` settings (indices) in each of ``rounds`` rounds (Note 2)."""
    if n < 1 or rounds < 1:
        raise ValueError(f"schedule needs at least one setting and one round, got n={n}, "
                         f"rounds={rounds}")
    if order == "balanced":
        w = [0]
        for i in range(1, n):
            w.append((i + 1) // 2 if i % 2 else n - i // 2)
        period = n if n % 2 == 0 else 2 * n
        out = []
        for r in range(rounds):
            k = r % period
            row = [(x + k) % n for x in w]
            out.append(row if k < n else row[::-1])
        return out
    if order == "shuffle":
        rng = random.Random(seed)
        return [rng.sample(range(n), n) for _ in range(rounds)]
    raise ValueError(f"order={order!r}: use 'balanced' or 'shuffle'")


@dataclass(frozen=True)
class Ratio:
    """A setting's step time over the baseline's, per round; the median and quartiles."""

    median: float
    low: float                      # 25th percentile of the per-round ratios
    high: float                     # 75th percentile
    per_round: tuple[float, ...]

    @classmethod
    def of(cls, ratios: list[float]) -> "Ratio":
        if len(ratios) == 1:
            return cls(ratios[0], ratios[0], ratios[0], tuple(ratios))
        q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        return cls(statistics.median(ratios), q1, q3, tuple(ratios))

    def __str__(self) -> str:
        return f"{self.median:.2f}x [{self.low:.2f}-{self.high:.2f}]"

    def to_dict(self) -> dict:
        return {"time_ratio": round(self.median, 4), "time_ratio_q1": round(self.low, 4),
                "time_ratio_q3": round(self.high, 4),
                "time_ratios_per_round": [round(r, 4) for r in self.per_round]}


@dataclass
class Timings:
    """Seconds of each setting in each round (round order), and the orders they ran in."""

    baseline: str
    seconds: dict[str, list[float]]                   # wall seconds, per round
    cpu_seconds: dict[str, list[float]] = field(default_factory=dict)   # process CPU (Note 4)
    orders: list[list[str]] = field(default_factory=list)

    def median_s(self, label: str, clock: str = "wall") -> float:
        return statistics.median(self._times(clock)[label])

    def ratio(self, label: str, against: str | None = None, clock: str = "wall") -> Ratio:
        """``label``'s time over ``against``'s (default: the baseline), round by round (Note 1)."""
        times = self._times(clock)
        base = times[against or self.baseline]
        return Ratio.of([t / b for t, b in zip(times[label], base)])

    def _times(self, clock: str) -> dict[str, list[float]]:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock={clock!r}: use 'wall' or 'cpu'")
        return self.seconds if clock == "wall" else self.cpu_seconds

    def row(self, label: str, against: str | None = None) -> dict:
        """The record fields of one setting: median and per-round seconds, wall and CPU
        ratios (the CPU ones prefixed ``cpu_``)."""
        out = {"step_seconds_median": round(self.median_s(label), 4),
               "step_seconds": [round(t, 4) for t in self.seconds[label]],
               **self.ratio(label, against).to_dict()}
        if self.cpu_seconds.get(label):
            out["cpu_step_seconds_median"] = round(self.median_s(label, "cpu"), 4)
            out.update({f"cpu_{k}": v
                        for k, v in self.ratio(label, against, "cpu").to_dict().items()})
        return out

    def summary(self) -> dict:
        """What a record says about the timing itself: rounds, orders, the control's ratio."""
        out = {"timing": "interleaved (benchmarks/_timing.py): every setting once per round, "
                         "balanced Latin-square order; ratios are medians of per-round ratios to the "
                         "baseline timed in the same round; time_ratio from wall time, "
                         "cpu_time_ratio from the process's CPU time",
               "baseline": self.baseline, "rounds": len(self.orders), "orders": self.orders}
        if CONTROL in self.seconds:
            out["control"] = self.ratio(CONTROL).to_dict()
            if self.cpu_seconds.get(CONTROL):
                out["control_cpu"] = self.ratio(CONTROL, clock="cpu").to_dict()
        return out


def interleave(steps: dict[str, Callable[[], object]], rounds: int, baseline: str, *,
               warmup: int = 0, order: str = "balanced", seed: int = 0,
               sync: Callable[[], object] | None = None,
               clock: Callable[[], float] = time.perf_counter,
               cpu_clock: Callable[[], float] = time.process_time,
               on_round: Callable[[int, int], object] | None = None) -> Timings:
    """Time every step once per round for ``rounds`` rounds (Notes 1, 2, 4)."""
    if baseline not in steps:
        raise ValueError(f"baseline {baseline!r} is not one of the steps {list(steps)}")
    labels = list(steps)
    plan = schedule(len(labels), rounds, order, seed)
    for _ in range(warmup):
        for i in plan[0]:
            steps[labels[i]]()
    if sync is not None:
        sync()
    out = Timings(baseline, {label: [] for label in labels}, {label: [] for label in labels})
    for r, idx in enumerate(plan):
        if on_round is not None:
            on_round(r, rounds)
        for i in idx:
            start, start_cpu = clock(), cpu_clock()
            steps[labels[i]]()
            if sync is not None:
                sync()
            out.seconds[labels[i]].append(clock() - start)
            out.cpu_seconds[labels[i]].append(cpu_clock() - start_cpu)
        out.orders.append([labels[i] for i in idx])
    return out
