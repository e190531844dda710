"""The replay matcher maps a real CPU step's allocations onto the estimate's static plan.

The recorded sequence is a real run's (``memfit.track`` on real tensors, its ledger read by
``storage_log``), the plan the fake trace's: on the CPU they agree to the byte, so in steady
state every allocation is a hit; each injected size change is counted once."""

import numpy as np

import memfit
from memfit.memplan import static_plan, storage_log
from memfit.memplan.replay_match import ReplayMatcher
from tests.helpers import tiny, track_real_step


def _events(log):
    """The step's births and deaths in event order, as (is_birth, version), and each born
    version's birth rank."""
    born = [v for v in np.argsort(log.birth_event, kind="stable") if log.birth_event[v] >= 0]
    rank = {int(v): k for k, v in enumerate(born)}
    events = sorted([(int(log.birth_event[v]), 1, int(v)) for v in born] +
                    [(int(log.death_event[v]), 0, int(v)) for v in range(len(log.nbytes))
                     if log.death_event[v] < log.num_events and log.birth_event[v] >= 0])
    return [(bool(is_birth), v) for _, is_birth, v in events], rank


def _replay(matcher, log, change=()):
    """Feed the log's births and deaths (in event order) to the matcher; ``change``: birth
    ranks whose size is altered by 4 bytes."""
    events, rank = _events(log)
    handles = {}
    matcher.begin_step()
    for is_birth, v in events:
        if is_birth:
            size = int(log.nbytes[v]) + (4 if rank[v] in change else 0)
            handles[v], _ = matcher.malloc(size)
        elif v in handles:
            matcher.free(handles.pop(v))


def test_a_real_step_maps_onto_the_plan_and_every_injected_mismatch_is_counted():
    model, batch = tiny("gpt2", batch_size=2, seq_len=16)
    plan = static_plan(memfit.estimate(model, batch, optimizer="adamw", device="cpu"))
    log = storage_log(track_real_step(model, batch))
    matcher = ReplayMatcher(plan)
    _replay(matcher, log)
    expected = sum(a.first_op >= 0 for a in plan.assignments)
    assert (matcher.stats.hits, matcher.stats.misses, matcher.stats.beyond_plan,
            matcher.stats.conflicts) == (expected, 0, 0, 0)
    again = ReplayMatcher(plan)
    _replay(again, log, change={3, 40, 41})
    assert again.stats.misses == 3 and again.stats.hits == expected - 3
    assert again.stats.conflicts == 0
