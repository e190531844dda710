"""The precision search under "auto" (issue 15 item 3): fp32 (first after the 16-bit one where
the GPU's 16-bit matmuls gain nothing), bf16 autocast and bf16-pure where the GPU has bf16, fp16
where it has not; the plan says which numerics change and why.

Oracles: the GPU table's own rates (a card whose fp16 rate is below its fp32 rate, the GTX 1080
Ti's 0.18 vs 11.3 TFLOP/s, must weigh fp32), and ``memfit.estimate`` of the plan's own knobs
(the CUDA model: there is no GPU here, so these figures are modelled, never measured).
"""

import pytest

import memfit
from memfit.devices import get_device
from memfit.planner.time_model import flop_rate
from memfit.planner.variants import auto_precisions
from memfit.trace.allocator import AllocatorConfig
from tests.helpers import tiny


@pytest.mark.parametrize("gpu,expected", [
    ("gtx-1080-ti", ["fp16", "fp32"]),       # Pascal: no bf16, fp16 matmuls at fp32's rate
    ("t4", ["fp16", "fp32"]),                # Turing: fp16 tensor cores, no bf16
    ("a100-40gb", ["bf16", "bf16-pure", "fp32"]),    # Ampere: bf16 tensor cores
    ("cpu", ["fp32"]),
])
def test_auto_weighs_the_precisions_the_card_supports(gpu, expected):
    spec = get_device(gpu)
    assert auto_precisions(spec) == expected
    if spec.kind == "cuda":     # fp32 right after the 16-bit one where that gains no rate
        half = expected[0]
        no_gain = flop_rate(spec, half) <= spec.peak_fp32_flops
        assert expected.index("fp32") == (1 if no_gain else len(expected) - 1)
        assert ("bf16" in expected) == spec.supports_bf16 == ("bf16-pure" in expected)


@pytest.mark.slow      # several modelled GPU traces of each precision (~1-2 min on 2 cores)
def test_auto_plans_say_which_numerics_change_and_fit_their_modelled_budget():
    model, batch = tiny("gpt2", batch_size=8, seq_len=128)
    del batch["attention_mask"]              # all ones: the plan would count it held
    pure, half = (memfit.estimate(model, batch, device="a100-40gb", precision=q).device_bytes
                  for q in ("bf16-pure", "bf16"))
    assert pure < half                       # the premise, modelled
    budget = (pure + half) // 2              # bf16-pure's plain step fits, bf16's does not
    p = memfit.plan(model, batch, budget=budget, device="a100-40gb", precision="auto")
    assert p.knobs.precision in ("bf16", "bf16-pure", "fp32")
    assert not p.knobs.remat                 # one fixed batch: a static plan (test_levers_dtr)
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    # traced under the allocator setting the plan chose (api._plan_allocator)
    assert p.allocator is None or p.allocator["scheme"] == "default"   # pools: not here
    config = AllocatorConfig(expandable_segments=bool(p.allocator and
                                                      p.allocator["expandable_segments"]))
    est = memfit.estimate(model, batch, device="a100-40gb", allocator=config, **knobs)
    assert est.device_bytes == p.predicted_device_bytes <= budget
    if p.knobs.precision != "fp32":
        said = next(r for r in p.reasons if r.startswith(f"precision {p.knobs.precision}"))
        assert "numerics change" in said or "change to the numerics" in said
        assert "supports" in said and "bf16" in said         # why: the card's support
