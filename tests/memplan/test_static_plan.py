"""``memfit.memplan.static_plan`` on traced steps, checked against independent counts.

Oracles: the layout is checked by a sweep written here (not the planner's code); the
lifetimes by the tracker's own timeline (live bytes after each op, resolved from the ledger's
event log, a different path than the intervals); the lower bound by ``memfit.track`` on a
real CPU step; the allocator replay by ``trace.cuda``'s (the estimate's reserved bytes, default
and expandable segments).
"""

import numpy as np
import pytest

import memfit
from memfit import zoo
from memfit.memplan import static_plan
from memfit.memplan._pools import allocator_options
from memfit.trace.allocator import AllocatorConfig, round_size
from tests.helpers import tiny, track_real_step
from tests.memplan.conftest import tiny_estimate


def overlapping_pairs(assignments) -> list:
    """Pairs of assignments live at a common op point whose byte ranges intersect. Two
    intervals that overlap in time share the later one's first point, so checking at every
    first point finds every pair."""
    bad = []
    first = np.array([a.first_op for a in assignments])
    last = np.array([a.last_op for a in assignments])
    off = np.array([a.offset for a in assignments])
    end = off + np.array([a.size for a in assignments])
    for t in np.unique(first):
        live = np.flatnonzero((first <= t) & (last >= t))
        order = live[np.argsort(off[live], kind="stable")]
        clash = np.flatnonzero(end[order][:-1] > off[order][1:])
        bad += [(int(order[i]), int(order[i + 1])) for i in clash]
    return bad


def live_at_points(assignments, num_ops) -> list[int]:
    """Bytes live at op points 0..num_ops-1, summed directly from the assignments."""
    out = [0] * num_ops
    for a in assignments:
        for t in range(max(a.first_op, 0), a.last_op + 1):
            out[t] += a.size
    return out


def test_cpu_plan_is_valid_and_its_lifetimes_are_the_traced_timeline(gpt2_cpu):
    sp = static_plan(gpt2_cpu)
    assert overlapping_pairs(sp.assignments) == []
    assert sp.num_ops == len(gpt2_cpu.timeline)
    # every op point's live bytes, from the intervals, equal the tracker's timeline
    assert live_at_points(sp.assignments, sp.num_ops) == gpt2_cpu.timeline
    assert sp.lower_bound_bytes == gpt2_cpu.peak_bytes
    assert sp.arena_bytes >= sp.lower_bound_bytes
    assert sp.arena_bytes == max(a.offset + a.size for a in sp.assignments)
    assert sum(a.size for a in sp.assignments if a.category == "params") == \
        gpt2_cpu.breakdown["params"]


def test_gpu_plan_rounds_to_blocks_and_reserved_is_the_allocator_models(gpt2_gpu):
    sp = static_plan(gpt2_gpu)
    assert overlapping_pairs(sp.assignments) == []
    assert all(a.size % 512 == 0 for a in sp.assignments)
    # the estimate's allocated peak also counts unsplit blocks' remainders (allocator Note 2)
    assert sp.lower_bound_bytes <= gpt2_gpu.peak_bytes
    assert sp.reserved_bytes == gpt2_gpu.reserved_bytes
    assert sp.lower_bound_bytes <= sp.arena_bytes <= sp.reserved_bytes


def test_replay_of_the_log_is_trace_cuda_replay_default_and_expandable(gpt2_gpu):
    """memplan's own replay (one pool) gives the estimate's reserved bytes, with the default
    allocator and with expandable segments (a second estimate made with that setting)."""
    opts = {o.name: o for o in allocator_options(gpt2_gpu).options}
    assert opts["default"].reserved_bytes == gpt2_gpu.reserved_bytes
    assert opts["default"].allocated_bytes == gpt2_gpu.peak_bytes
    exp = tiny_estimate("gpt2", "a100-80gb", allocator=AllocatorConfig(expandable_segments=True))
    assert opts["default + expandable_segments"].reserved_bytes == exp.reserved_bytes


def test_lower_bound_is_tracks_measured_peak_on_a_real_cpu_step():
    model, batch = tiny("llama-1b", batch_size=2, seq_len=16)
    est = memfit.estimate(model, batch, optimizer="adamw", device="cpu")
    t = track_real_step(model, batch)
    sp = static_plan(est)
    assert sp.lower_bound_bytes == t.peak_bytes
    assert overlapping_pairs(sp.assignments) == []
    own = static_plan(t)                 # the real run's own allocation sequence, planned
    assert overlapping_pairs(own.assignments) == []
    assert own.lower_bound_bytes == t.peak_bytes and own.arena_bytes >= t.peak_bytes
    assert own.num_ops == len(t.timeline) and \
        live_at_points(own.assignments, own.num_ops) == t.timeline


@pytest.mark.parametrize("name", [n if n == "bert-base" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in zoo.names()])
def test_zoo_architectures_valid_on_a_gpu_estimate(name):
    est = tiny_estimate(name, "gtx-1080-ti")
    sp = static_plan(est)
    assert overlapping_pairs(sp.assignments) == []
    assert sp.lower_bound_bytes <= sp.arena_bytes <= 1.02 * sp.lower_bound_bytes   # issue 17
    live = np.array(live_at_points(sp.assignments, sp.num_ops))
    at_start = sum(a.size for a in sp.assignments if a.first_op == -1)
    assert max(int(live.max()), at_start) == sp.lower_bound_bytes


def test_block_rounding_matches_round_size(gpt2_gpu):
    sp = static_plan(gpt2_gpu)
    life = gpt2_gpu.lifetimes.window()
    assert [a.size for a in sp.assignments[:len(life)]] == \
        [round_size(int(n)) for n in life.nbytes]
    workspaces = sp.assignments[len(life):]        # cuBLAS's, alive throughout (static_plan Note 1)
    assert sum(a.size for a in workspaces) == gpt2_gpu.device.cublas_workspace_bytes + \
        gpt2_gpu.device.autograd_workspace_bytes


def test_bad_inputs_say_what_to_do(gpt2_cpu):
    with pytest.raises(ValueError, match="align_bytes must be an int >= 1"):
        static_plan(gpt2_cpu, align_bytes=0)
    with pytest.raises(ValueError, match="exact_max_storages"):
        static_plan(gpt2_cpu, exact_max_storages=-1)

    class NoLifetimes:
        lifetimes = None

    with pytest.raises(ValueError, match="carries no storage lifetimes"):
        static_plan(NoLifetimes())


def test_align_bytes_rounds_every_size(gpt2_cpu):
    sp = static_plan(gpt2_cpu, align_bytes=64)
    assert all(a.size % 64 == 0 and a.offset % 64 == 0 for a in sp.assignments)
    assert sp.lower_bound_bytes >= gpt2_cpu.peak_bytes
    assert overlapping_pairs(sp.assignments) == []


def test_estimate_keeps_no_tensor(gpt2_cpu):
    log = gpt2_cpu.lifetimes
    assert all(isinstance(v, (np.ndarray, int)) for v in vars(log).values())
