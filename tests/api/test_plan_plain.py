"""One meaning for "plain step": the user's own step at the user's precision (issue 11 item 12).

Under precision="auto" on a bf16 GPU the planner searches bf16, but the plain step is the
fp32 step the user runs (traced: ``Planned.plain``); a plan that changes the precision says so,
and its ratio below 1 is a speed-up. No byte count in a plan is negative; host RAM appears
only where something is offloaded, and then it is the re-trace's host peak.
"""

import json

import pytest

import memfit
from memfit.units import format_bytes
from memfit.api.plan import plan_traced
from tests.helpers import tiny


def _ints(value):
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _ints(v)
    elif isinstance(value, list):
        for v in value:
            yield from _ints(v)


def _bert_base(layers=2):
    """bert-base's widths on the meta device: its matmuls, not its launches, set the time."""
    from memfit import zoo
    spec = zoo.get("bert-base")
    model = spec.build(device="meta", num_hidden_layers=layers)
    return model, spec.make_batch(model, 8, seq_len=128)


@pytest.mark.slow
def test_auto_plain_step_is_the_users_fp32_step():
    model, batch = _bert_base()
    fp32 = memfit.estimate(model, batch, device="rtx-3090", precision="fp32")
    planned = plan_traced(model, batch, device="rtx-3090", precision="auto")
    assert planned.plain.knobs.precision == "fp32"
    assert planned.plain.device_bytes == fp32.device_bytes
    p = planned.plan
    assert p.knobs.precision == "bf16"
    assert not any("nothing to change" in r for r in p.reasons)
    assert any("not your fp32" in r for r in p.reasons)
    assert p.predicted_step_time_ratio < 1 and "speed-up" in p.explain()
    assert "slowdown" not in p.explain()


@pytest.mark.slow
def test_fp32_plain_fit_changes_nothing():
    model, batch = tiny("bert-base", batch_size=2, seq_len=16)
    p = memfit.plan(model, batch, device="rtx-3090")
    assert p.knobs.precision == "fp32" and p.predicted_step_time_ratio == 1.0
    assert any("nothing to change" in r for r in p.reasons)
    assert "the same time" in p.explain()
    # a tiny model: bf16's casts cost more launches than its matmuls save, so auto keeps fp32
    q = memfit.plan(model, batch, device="rtx-3090", precision="auto")
    assert q.knobs.precision == "fp32" and q.predicted_step_time_ratio == 1.0
    assert any("auto keeps fp32" in r for r in q.reasons)


@pytest.mark.slow
def test_no_negative_bytes_and_host_ram_only_when_offloading():
    model, batch = tiny("bert-base", batch_size=2, seq_len=16)
    for dev in ("cpu", "rtx-3090"):
        p = memfit.plan(model, batch, device=dev)
        assert min(_ints(json.loads(p.to_json()))) >= 0
        assert p.predicted_optimizer_step_bytes >= 0
        assert "host RAM" not in p.explain() and "host RAM" not in " ".join(p.reasons)
        assert not getattr(p, "predicted_host_bytes", 0)
    planned = plan_traced(model, batch, device="rtx-3090", offload_optimizer=True,
                          micro_batch_size=2)
    p, host = planned.plan, planned.chosen.host_peak_bytes
    assert host > 0
    shown = getattr(p, "predicted_host_bytes", None)
    if shown is not None:
        assert shown == host and "host RAM" in p.explain()
    else:
        assert any("host RAM" in r and format_bytes(host) in r for r in p.reasons)
