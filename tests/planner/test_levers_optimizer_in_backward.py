"""The optimizer stepped in backward as a planner lever (issue 28 items 3 and 6): weighed once the
plain step does not fit, by its traced memory, for the whole batch only (no accumulation).

The job: an MLP (64 -> 256 -> 256 -> 8, batch 4) with for-loop AdamW, the optimizer state kept on
the device. Its plain step peaks in the optimizer step, with every gradient alive; accumulation
and recompute cannot lower that point, and the optimizer in backward can (it holds one gradient
at a time). The budget is halfway between the two estimates.

Oracles that are not the planner: ``LiveBytes`` over a real ``Runner`` step
(``tests/live_bytes.py``), and the same model trained by hand with the plain grouped AdamW (the
parameters ``torch.equal`` after three steps: tests/techniques/test_optimizer_in_backward.py says
why the math is the same).
"""

import pytest
import torch

import memfit
from memfit.api.estimate import estimate
from memfit.planner.memory_model import MemoryModel
from memfit.planner.choice import Constraints, variant_key
from memfit.planner.search import floor_candidates, search
from memfit.planner.time_model import TimeModel
from tests.live_bytes import LiveBytes, alive_storages, job_tensors
from tests.techniques.test_optimizer_in_backward import _mlp, _mlp_batch, _mlp_loss


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def _job(model, x):
    return memfit.Job(model, x, optimizer=_adamw, loss_fn=_mlp_loss)


def _budget() -> int:
    model, x = _mlp(), _mlp_batch()
    plain = memfit.estimate(_job(model, x), device="cpu").peak_bytes
    fused = memfit.estimate(_job(model, x), device="cpu", optimizer_in_backward=True).peak_bytes
    assert fused < plain
    return (plain + fused) // 2


def test_plan_takes_it_where_only_it_fits_and_the_run_stays_under_bitwise():
    budget = _budget()
    reference, x = _mlp(), _mlp_batch()                  # trained by hand, the plain way
    before = alive_storages()
    model = _mlp()
    runner = memfit.fit(_job(model, x), budget=budget, device="cpu", offload_optimizer=False)
    p = runner.plan
    assert p.knobs.optimizer_in_backward is True and p.knobs.micro_batch_size == 4
    assert p.predicted_peak_bytes <= budget
    assert any(r.startswith("optimizer in backward (optimizer_in_backward=True)")
               for r in p.reasons)
    assert "optimizer stepped in backward" in p.explain()
    assert any("no re-plan on out-of-memory" in n for n in runner.applied.notes)
    for _ in range(2):
        runner.step(x)
    with LiveBytes(device_tensors=job_tensors(before)) as live:
        runner.step(x)
    runner.close()
    assert live.peak_bytes == p.predicted_peak_bytes <= budget
    opt = _adamw(reference.parameters())
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        _mlp_loss(reference, x).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_the_search_never_pairs_it_with_micro_batches():
    """The lever's model holds for the whole batch only (``whole_batch``): the floor's
    candidates and a search with a smaller micro-batch fixed never take it there."""
    model, x = _mlp(), _mlp_batch()
    b = 4

    def traced(part, **knobs):
        return estimate(model, part, _adamw, device="cpu", loss_fn=_mlp_loss,
                        allocator_replay=False, **knobs)

    models = {}       # as the planner builds them: the plain one from two batch sizes
    for key, knobs, half in ((("fp32", None), {}, traced(x[:2])),
                             (variant_key("fp32", None, in_backward=True),
                              {"optimizer_in_backward": True}, None)):
        est = traced(x, **knobs)
        memory = MemoryModel(est, b, half).limited(placements=(False,), whole_batch=bool(knobs))
        models[key] = (memory, TimeModel(est, memfit.devices.cpu_spec(), "fp32", b, memory,
                                         half))
    fused = [c for c in floor_candidates(models, b) if c.optimizer_in_backward]
    assert fused and all(c.micro_batch_size == b for c in fused)
    budget = _budget()                   # only the optimizer in backward fits, at the batch
    choice = search(models, b, budget)
    assert choice.optimizer_in_backward and choice.micro_batch_size == b
    assert search(models, b, budget, Constraints(micro_batch_size=1)) is None
    anywhere = search(models, b, 10 ** 9, Constraints(micro_batch_size=1))
    assert anywhere.micro_batch_size == 1 and not anywhere.optimizer_in_backward


def test_a_fixed_optimizer_in_backward_is_in_every_trace():
    model, x = _mlp(), _mlp_batch()
    p = memfit.plan(_job(model, x), budget="1GiB", device="cpu", optimizer_in_backward=True)
    est = memfit.estimate(_job(model, x), device="cpu", optimizer_in_backward=True)
    assert p.knobs.optimizer_in_backward and p.knobs.micro_batch_size == 4
    assert p.predicted_peak_bytes == est.peak_bytes
    with pytest.raises(memfit.BudgetTooSmall) as info:     # nothing else fits (module note)
        memfit.plan(_job(model, x), budget=_budget(), device="cpu", offload_optimizer=False,
                    optimizer_in_backward=False)
    assert "the optimizer in backward (optimizer_in_backward=False)" in str(info.value)
