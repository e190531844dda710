"""track() against hand-counted sums, and its budget enforcement."""

import pytest
import torch
from torch import nn

import memfit
from memfit.step import canonical_step


def nbytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def mlp_setup(optimizer="adamw"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return model, opt, x, y


def step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_entry_and_exit_bytes_equal_hand_counted_sums():
    model, opt, x, y = mlp_setup()
    step(model, opt, x, y)          # steady state: optimizer state and grads exist
    params = list(model.parameters())
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    # AdamW keeps exp_avg and exp_avg_sq (same size as the param) and a 0-d fp32 step count
    opt_bytes = sum(2 * p.numel() * p.element_size() + 4 for p in params)
    input_bytes = x.numel() * 4 + y.numel() * 8
    with memfit.track(model, opt) as t:
        loss = step(model, opt, x, y)
    r = t.resolved
    assert r.base_bytes == p_bytes + p_bytes + opt_bytes + input_bytes
    assert r.base_by_category.tolist()[:3] == [p_bytes, p_bytes, opt_bytes]
    # at the end: params, fresh grads, state, inputs and the returned 0-d loss (4 bytes)
    assert t.current_bytes == 2 * p_bytes + opt_bytes + input_bytes + loss.untyped_storage().nbytes()
    assert t.breakdown["params"] == p_bytes
    assert t.breakdown["optimizer"] == opt_bytes
    assert t.peak_bytes == max(t.timeline + [r.base_bytes])


def test_breakdown_sums_to_peak_and_activations_are_what_autograd_saved():
    model, opt, x, y = mlp_setup("sgd")
    step(model, opt, x, y)
    with memfit.track(model, opt) as t:
        opt.zero_grad(set_to_none=True)
        h = model[0](x)                       # saved by GELU (its input)
        out = model[2](model[1](h))           # GELU output saved by the second Linear
        loss = nn.functional.cross_entropy(out, y)
        saved_at_loss = t.ledger.current_bytes
        loss.backward()
        opt.step()
    assert sum(t.breakdown.values()) == t.peak_bytes
    # the forward peak holds h (32x128 fp32) and gelu(h) (32x128 fp32) as activations
    assert t.modules["1"].saved_bytes == 32 * 128 * 4          # GELU saves its input h
    assert t.modules["2"].saved_bytes == 32 * 128 * 4          # Linear saves gelu(h), not weights
    assert t.modules["0"].saved_bytes == 32 * 64 * 4           # Linear saves x
    assert t.modules["0"].input_bytes == 32 * 64 * 4
    assert t.modules[""].param_bytes == nbytes(model.parameters())
    assert saved_at_loss > 0


def test_flops_are_the_matmul_flops():
    model, opt, x, y = mlp_setup("sgd")
    with memfit.track(model, opt) as t:
        step(model, opt, x, y)
    # forward: 2*B*in*out per Linear. backward: grad of input (not for the first Linear,
    # whose input needs no grad) and grad of weight, each 2*B*in*out.
    f1, f2 = 2 * 32 * 64 * 128, 2 * 32 * 128 * 10
    assert t.fw_flops == f1 + f2
    assert t.bw_flops == f1 + 2 * f2
    assert t.modules["0"].fw_flops == f1 and t.modules["2"].bw_flops == 2 * f2


def test_per_module_peaks_lie_within_the_step_peak():
    model, opt, x, y = mlp_setup()
    step(model, opt, x, y)
    with memfit.track(model, opt) as t:
        step(model, opt, x, y)
    root = t.modules[""]
    assert 0 < root.fw_peak_bytes <= t.peak_bytes
    assert 0 < root.bw_peak_bytes <= t.peak_bytes
    for rec in t.modules.values():
        assert rec.fw_peak_bytes <= root.fw_peak_bytes
        assert rec.calls == 1


def test_views_count_their_storage_once_and_frees_are_seen():
    with memfit.track() as t:
        a = torch.ones(1000)                # 4000 B
        views = [a[1:], a.view(10, 100), a[::2]]
        b = a * 2                           # 4000 B
        del b
        c = a + 1                           # 4000 B, after b died
        del views, a
    assert t.peak_bytes == 8000
    assert t.current_bytes == 4000          # only c survives
    assert c.numel() == 1000


def test_budget_raises_at_the_op_that_crosses_it_and_leaves_no_trace():
    model, opt, x, y = mlp_setup()
    step(model, opt, x, y)
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"])
    phases = {}
    with memfit.track(model, opt) as free:
        canonical_step(model, opt, {"x": x, "y": y}, loss_fn,
                       on_phase=lambda name: phases.setdefault(name, free.ops))
    # a budget just under the forward's highest point: the first op past it is the culprit
    # (from the forward's first op: before it, zero_grad frees the previous step's grads)
    first, last = phases["forward"], phases["backward"]
    budget = max(free.timeline[first:last]) - 1
    culprit = next(i for i in range(first, last) if free.timeline[i] > budget)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(memfit.OutOfMemory) as info:
        with memfit.track(model, opt, budget=budget) as t:
            canonical_step(model, opt, {"x": x, "y": y}, loss_fn)
    e = info.value
    assert isinstance(e, torch.OutOfMemoryError)
    assert e.op == str(free.op_log[culprit])
    assert t.ops == culprit + 1                 # nothing ran after it
    assert e.budget_bytes == budget
    assert e.live_bytes <= budget < e.live_bytes + e.requested_bytes
    for word in ("requests", "live", "budget", e.op):
        assert word in str(e)
    for p, b in zip(model.parameters(), before):  # the optimizer never ran
        assert torch.equal(p, b)


def test_budget_on_a_random_op_restores_the_generator():
    torch.manual_seed(3)
    state = torch.get_rng_state()
    with pytest.raises(memfit.OutOfMemory) as info:
        with memfit.track(budget=1000):
            torch.rand(1000)
    assert "aten.rand" in info.value.op
    assert torch.equal(torch.get_rng_state(), state)


def test_budget_on_an_op_that_writes_and_allocates_restores_its_inputs():
    bn = nn.BatchNorm1d(8)
    bn.train()
    x = torch.randn(16, 8)
    mean_before = bn.running_mean.clone()
    with pytest.raises(memfit.OutOfMemory):
        with memfit.track(bn, budget=100):
            bn(x)
    assert torch.equal(bn.running_mean, mean_before)


def test_budget_accepts_strings_and_rejects_nonsense():
    with memfit.track(budget="1 MiB") as t:
        torch.zeros(10)
    assert t.budget_bytes == 1024**2
    with pytest.raises(ValueError, match="11GiB"):
        memfit.track(budget="eleven gigs")


def test_exceptions_inside_name_the_op_and_module():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2))
    with pytest.raises(RuntimeError) as info:
        with memfit.track(model) as t:
            model(torch.randn(2, 4))
    assert t.failed_module == "1"
    assert "aten" in t.failed_op
    assert any("module '1'" in n for n in getattr(info.value, "__notes__", []))


def test_canonical_step_under_track_counts_model_and_optimizer_from_the_start():
    model, opt, x, y = mlp_setup()
    canonical_step(model, opt, {"x": x}, loss_fn=lambda m, b: nn.functional.cross_entropy(m(b["x"]), y))
    with memfit.track(model, opt) as t:
        canonical_step(model, opt, {"x": x}, loss_fn=lambda m, b: nn.functional.cross_entropy(m(b["x"]), y))
    assert t.breakdown["optimizer"] == sum(2 * p.numel() * 4 + 4 for p in model.parameters())


def test_host_allocations_are_counted_apart_from_the_device():
    from memfit.measure import host_allocations

    with memfit.track(budget=5000) as t:
        a = torch.ones(1000)                      # 4000 B on the device
        with host_allocations():
            h = torch.empty(2000)                 # 8000 B in the host pool: not under budget
            h[:1000].copy_(a)
        del a
        b = torch.ones(1000)                      # device again
    assert t.peak_bytes == 4000
    assert t.host_peak_bytes == 8000
    assert h.numel() == 2000 and b.numel() == 1000


# every knob fixed: the plan traces and verifies one configuration (a few seconds)
FIXED = dict(precision="fp32", micro_batch_size=3, checkpoint="none", offload="none",
             offload_optimizer=False)


def test_a_trace_run_inside_track_counts_nothing_and_is_not_confused_by_it():
    """estimate and plan inside a real track(budget=...) (issue 11 item 4). Oracle: the same
    real work tracked without the trace calls; and the same estimate made outside any track.
    The budget is exactly the real work's peak, so one fake byte counted would raise."""
    from memfit.step import prepare_batch
    from tests.helpers import tiny

    model, batch = tiny("gpt2")
    batch = prepare_batch(batch)
    opt = torch.optim.AdamW(model.parameters())
    canonical_step(model, opt, batch)                 # steady state: optimizer state exists
    outside = memfit.estimate(model, batch)

    def work(trace):
        canonical_step(model, opt, batch)
        if trace:
            found.append(memfit.estimate(model, batch))
            found.append(memfit.plan(model, batch, budget="64MiB", **FIXED))
        canonical_step(model, opt, batch)

    found = []
    with memfit.track(model, opt) as plain:
        work(trace=False)
    with memfit.track(model, opt, budget=plain.peak_bytes) as t:
        work(trace=True)
    inside, plan = found
    assert t.peak_bytes == plain.peak_bytes
    assert t.current_bytes == plain.current_bytes
    assert (t.fw_flops, t.bw_flops) == (plain.fw_flops, plain.bw_flops)   # no traced FLOPs
    # the trace's own tracker saw its step exactly as outside any track
    assert inside.peak_bytes == outside.peak_bytes
    assert inside.breakdown == outside.breakdown
    assert inside.timeline == outside.timeline
    assert inside.modules == outside.modules
    assert plan.predicted_peak_bytes <= 64 * 2**20


def test_a_forward_that_raised_inside_track_frees_its_activations():
    """The module-backward hooks must not keep a failed forward's graph alive in the region
    (an OOM guard retries inside it). Oracle: the live bytes before the forward. Before the
    fix the first block's graph stayed: 542 KiB of activations."""
    from memfit.step import prepare_batch
    from tests.helpers import tiny

    model, batch = tiny("gpt2")
    batch = prepare_batch(batch)

    def stop(module, args):
        raise RuntimeError("stop here")

    model.transformer.h[1].mlp.register_forward_pre_hook(stop)
    with memfit.track(model) as t:
        for v in batch.values():          # the batch is counted from its first read
            v.view(-1)
        before = t.ledger.current_bytes
        with pytest.raises(RuntimeError, match="stop here"):
            model(**batch)
        import gc
        gc.collect()
        assert t.ledger.current_bytes == before


def test_figures_read_inside_the_region_do_not_stick_after_it():
    """Reading peak_bytes while tracking resolves the ledger so far; the figures after exit
    must be the whole region's (a callback reads them step by step, then closes)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    x = torch.randn(32, 64)

    def step():
        model(x).sum().backward()

    model.zero_grad(set_to_none=True)
    with memfit.track(model) as whole:
        step()
        step()
    model.zero_grad(set_to_none=True)       # the same start for both regions
    t = memfit.track(model)
    t.__enter__()
    step()
    assert t.peak_bytes > 0                 # resolved while the region is open
    step()
    t.__exit__(None, None, None)
    assert t.peak_bytes == whole.peak_bytes and t.timeline == whole.timeline
