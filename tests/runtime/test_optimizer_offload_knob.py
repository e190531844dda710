"""offload_optimizer through fit and estimate: state in host memory, training unchanged."""

import torch

import memfit
from tests.helpers import tiny, track_next_run


def test_estimate_equals_track_and_moves_the_state_to_the_host():
    model, batch = tiny("gpt2", batch_size=4, seq_len=16)
    plain = memfit.estimate(model, batch, "adamw")
    est = memfit.estimate(model, batch, "adamw", offload_optimizer=True)
    runner = memfit.fit(model, torch.optim.AdamW(model.parameters()), batch, offload_optimizer=True)
    t = track_next_run(runner, batch)
    assert (est.peak_bytes, est.breakdown) == (t.peak_bytes, t.breakdown)
    assert est.breakdown["optimizer"] == 0 < plain.breakdown["optimizer"]
    assert est.peak_bytes < plain.peak_bytes
    assert t.host_peak_bytes >= plain.breakdown["optimizer"]
    assert runner.plan.optimizer_rebuilt and runner.applied.optimizer_rebuilt


def test_offloaded_runner_trains_bitwise_like_the_plain_one():
    results = []
    for offload in (False, True):
        model, batch = tiny("bert-base", batch_size=4)
        model.eval()
        runner = memfit.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batch,
                            offload_optimizer=offload, micro_batch_size=2, max_grad_norm=1.0)
        for _ in range(3):
            runner.step(batch)
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_scheduler_factory_drives_the_offloaded_optimizer_and_instances_are_refused():
    import pytest

    model, batch = tiny("bert-base", batch_size=4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    runner = memfit.fit(model, opt, batch, offload_optimizer=True,
                        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.0))
    runner.step(batch)
    before = [p.detach().clone() for p in model.parameters()]
    runner.step(batch)                      # lr is now 0: nothing moves
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="factory"):
        memfit.fit(model, opt, batch, offload_optimizer=True,
                   scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def test_refused_combination_leaves_the_model_untouched():
    import pytest

    model, batch = tiny("bert-base", batch_size=4)
    dtypes = [p.dtype for p in model.parameters()]
    with pytest.raises(ValueError, match="not supported yet"):
        memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                   precision="bf16-pure", offload_optimizer=True)
    assert [p.dtype for p in model.parameters()] == dtypes
    assert all("forward" not in vars(m) for m in model.modules())


def test_naming_a_container_is_refused():
    import pytest

    model, batch = tiny("gpt2")
    for knob in ("checkpoint", "offload"):
        with pytest.raises(ValueError, match="transformer.h.0"):
            memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), batch,
                       **{knob: ("transformer.h",)})
