"""A tracker's timelines read the resolved ledger per op point (measure.track): the arrays
equal the point-by-point reading (``Resolved.at`` / ``breakdown_at`` of each op's last event),
for a real step, a composed fake trace and a region with no op."""

import torch

import memfit
from memfit import zoo


def _by_points(t):
    r = t.resolved
    events = [e - 1 for e in t.op_events[len(t.op_log) - len(t.window_op_log):]]
    timeline = [r.at(e) for e in events]
    by_cat = {c: [] for c in memfit.measure._ledger.CATEGORIES}
    for e in events:
        for name, v in r.breakdown_at(e).items():
            by_cat[name].append(v)
    return timeline, by_cat


def _check(t):
    timeline, by_cat = _by_points(t)
    assert t.timeline == timeline and all(type(v) is int for v in t.timeline)
    assert t.timeline_by_category == by_cat


def test_a_real_step_s_timelines():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 16)
    with memfit.track(model, opt) as t:
        model(x).square().mean().backward()
        opt.step()
    _check(t)
    with memfit.track(model, opt) as empty:           # no op at all
        pass
    assert empty.timeline == [] and all(v == [] for v in empty.timeline_by_category.values())
    _check(empty)


def test_a_composed_trace_s_categories_add_up_to_its_timeline():
    """A composed fake trace (its tracker made by trace.block_reuse): at every op point the
    categories sum to the timeline, and the peak is the timeline's."""
    spec = zoo.get("xlm-roberta-large")
    model = spec.build(device="meta")
    est = memfit.estimate(memfit.Job(model, spec.make_batch(model, 1, seq_len=8)),
                          device="gtx-1080-ti", allocator_replay=False)
    assert est.traced_as.startswith("composed")
    sums = [sum(v) for v in zip(*est.timeline_by_category.values())]
    assert sums == est.timeline and max(est.timeline) == est.peak_bytes
