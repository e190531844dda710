"""The one verify -> retry -> floor loop every planner runs: one device (``api.plan``), the
sharded layouts (``api._plan_sharded``) and the Hugging Face Trainer's (``integrations._hf_plan``).

Note 1 (verification). The memory models propose; a re-trace of the proposal is the answer. A
proposal whose trace misses the budget lowers the cap of its family (a precision and optimizer
variant, a layout: whatever ``key`` the caller gives) by what was missing plus ``SLACK_BYTES``,
so the next search does not land on the same bytes, and the search runs again, ``ATTEMPTS``
times at most. Where the caller gives the models' prediction of the proposal, the cap is
lowered at least by the models' error on it (traced less predicted) plus ``SLACK_BYTES``: a
proposal predicted well under its cap (the modes are discrete) that missed by a few bytes
would otherwise fit the lowered cap and be proposed, and traced, again (a 2-block model at 85
x 32 on an RTX 4090 under 700 MiB: bf16-pure predicted 727.4 MB, traced 734.02 MB, 21 KB over;
its cap lowered by 1.07 MB still held it). The error is the family's: its next proposals are
weighed as if the models under-predict them as much. A family that missed ``drop_after`` times is dropped where other families remain
(its cap set to the whole budget), so the next attempts weigh the others; the models' errors
cost speed, never the budget.

Note 2 (the floor). The least device bytes of the configurations the models call least-memory,
each traced (``least_traced``): a candidate the models put more than ``FLOOR_PRUNE`` above both
their least and the least traced so far is not traced, and two candidates with the same
``ident`` are traced once. The least traced is part of the cutoff because a model can be far
too optimistic: where the candidate it puts lowest traces far above that, the candidates it put
near the true least must still be traced (``tests/planner/test_least_traced.py``). The caller
gets every traced candidate (``traced_candidates``), the least first, to confirm them in turn
where its traces are bounds (a GPU's, without the allocator replayed: ``api._floor``). The
floor is never above a verified plan of the same call (``Margins.seen``: the least verified
bytes), so a budget of exactly the floor plans.

The estimator is passed in (``verify`` and ``trace`` callables): nothing here traces by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTEMPTS", "SLACK_BYTES", "FLOOR_PRUNE", "Margins", "Verified", "verify_loop",
           "least_traced", "traced_candidates"]

ATTEMPTS = 5               # searches per call before the floor is asked (Note 1)
SLACK_BYTES = 2 ** 20      # added to each verified shortfall, so a retry does not land on it
FLOOR_PRUNE = 1.5          # floor candidates the models put this far above the least go untraced


class Margins:
    """Per family, the bytes its cap is lowered by (Note 1); a dict the searches read."""

    def __init__(self, budget_bytes: int, *, drop_after: int = 2):
        self.budget_bytes = budget_bytes
        self.drop_after = drop_after
        self.bytes: dict[Hashable, int] = {}
        self.misses: dict[Hashable, int] = {}
        self.least_verified: int | None = None     # the least device bytes verified (Note 2)

    def start(self, key: Hashable, held_bytes: int = 0) -> None:
        """A family's first margin: bytes held beside the step (the caller's batch)."""
        self.bytes.setdefault(key, held_bytes)

    def get(self, key: Hashable, default: int = 0) -> int:
        return self.bytes.get(key, default)

    def seen(self, device_bytes: int) -> None:
        """A verified trace's device bytes (the floor is never above them, Note 2)."""
        if self.least_verified is None or device_bytes < self.least_verified:
            self.least_verified = device_bytes

    def missed(self, key: Hashable, device_bytes: int, predicted_bytes: int | None = None
               ) -> bool:
        """``key``'s proposal re-traced at ``device_bytes``, over the budget: lower its cap by
        the shortfall plus ``SLACK_BYTES``, and at least by the models' error on it where
        ``predicted_bytes`` (what they said it needs) is given (Note 1); whether the family may
        be proposed again."""
        self.seen(device_bytes)
        self.misses[key] = self.misses.get(key, 0) + 1
        others = [k for k, v in self.bytes.items() if k != key and v < self.budget_bytes]
        if self.misses[key] >= self.drop_after and others:
            self.bytes[key] = self.budget_bytes
            return False
        margin = self.bytes.get(key, 0) + device_bytes - self.budget_bytes + SLACK_BYTES
        if predicted_bytes is not None:
            margin = max(margin, device_bytes - predicted_bytes + SLACK_BYTES)
        self.bytes[key] = margin
        return self.bytes[key] < self.budget_bytes and self.misses[key] < ATTEMPTS


@dataclass
class Verified:
    """A proposal whose re-trace fits: the candidate, its trace, and on which attempt."""

    candidate: Any
    trace: Any
    device_bytes: int
    attempt: int                 # 0: the first proposal fitted


def verify_loop(search: Callable[[Margins], Any], verify: Callable[[Any], tuple[Any, int]],
                key: Callable[[Any], Hashable], margins: Margins, *, attempts: int = ATTEMPTS,
                fits: Callable[[Any, int], bool] | None = None,
                predicted: Callable[[Any], int] | None = None,
                say: Callable[[str], None] = lambda message: None) -> Verified | None:
    """Note 1: ``search(margins)`` proposes (None: nothing fits the models), ``verify(c)``
    re-traces it as ``(trace, device bytes)``; ``fits(trace, device_bytes)`` (default: within
    the budget) accepts it; ``predicted(c)``: the device bytes the models gave ``c``, counted
    as ``verify`` counts them. Returns the first accepted, or None."""
    for attempt in range(attempts):
        say("searching" if attempt == 0 else f"searching again (attempt {attempt + 1})")
        c = search(margins)
        if c is None:
            return None
        trace, device_bytes = verify(c)
        ok = fits(trace, device_bytes) if fits is not None else \
            device_bytes <= margins.budget_bytes
        if ok:
            margins.seen(device_bytes)
            return Verified(c, trace, device_bytes, attempt)
        margins.missed(key(c), device_bytes, predicted(c) if predicted is not None else None)
    return None


def least_traced(candidates: Iterable, *, predicted: Callable[[Any], int],
                 ident: Callable[[Any], Hashable], trace: Callable[[Any], tuple[int, Any]],
                 say: Callable[[str], None] = lambda message: None,
                 describe: Callable[[Any], str] = str) -> tuple[int, Any, Any]:
    """Note 2: ``(device bytes, candidate, its trace)`` of the least traced candidate;
    ``predicted(c)``: the models' bytes (for the pruning), ``trace(c)`` -> ``(device bytes,
    trace)``."""
    return traced_candidates(candidates, predicted=predicted, ident=ident, trace=trace,
                             say=say, describe=describe)[0]


def traced_candidates(candidates: Iterable, *, predicted: Callable[[Any], int],
                      ident: Callable[[Any], Hashable], trace: Callable[[Any], tuple[int, Any]],
                      say: Callable[[str], None] = lambda message: None,
                      describe: Callable[[Any], str] = str) -> list[tuple[int, Any, Any]]:
    """Every candidate ``least_traced`` traces, as ``(device bytes, candidate, trace)``, the
    least first."""
    candidates = sorted(candidates, key=predicted)
    if not candidates:
        raise ValueError("no floor candidate: the search space is empty")
    reference = predicted(candidates[0])       # the least predicted, or traced if above
    seen, traced = set(), []
    for c in candidates:
        i = ident(c)
        if i in seen or predicted(c) > reference * FLOOR_PRUNE:
            continue
        seen.add(i)
        say(f"tracing a least-memory candidate: {describe(c)}")
        device_bytes, est = trace(c)
        traced.append((device_bytes, c, est))
        reference = max(predicted(candidates[0]), min(t[0] for t in traced))
    return sorted(traced, key=lambda t: t[0])
