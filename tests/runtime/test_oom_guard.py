"""The OOM guard: an effective batch that runs out of memory is restored, re-planned and run
again, and training ends bitwise where an uninterrupted run of the new plan ends.

Oracle: the same tiny GPT-2 (dropout on), the same seeds before each step, trained by
``memfit.fit`` with the old plan up to the step that ran out of memory and with the new plan
from there on (from the start when it is the first step). Parameters, optimizer state and the
GradScaler's state must be ``torch.equal``; the dropout masks only match if the guard restored
the RNG, and the loss scale's growth counter only if it kept the old scaler.
"""

import copy
import dataclasses

import pytest
import torch

import memfit
from memfit.api._setup import build_runner
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.runtime import Runner
from tests.helpers import equal_params, tiny

STEPS = 3
OLD = dict(micro_batch_size=2, max_grad_norm=1.0)                     # 2 micro-batches of 2
NEW = dict(micro_batch_size=1, max_grad_norm=1.0, checkpoint="all")   # 4 micro-batches of 1


def setup(precision="fp32", **old):
    model, batch = tiny("gpt2", batch_size=4, seq_len=16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, batch, memfit.fit(model, opt, batch, precision=precision,
                                         **(old or OLD))


def replanner(runner, precision="fp32", calls=None, plan=None, **knobs):
    """``replan`` for ``runner``: a Runner over the same model and optimizer with ``knobs``
    (default NEW); records each excess in ``calls``."""
    model, opt = runner.model, runner.optimizer

    def replan(excess):
        if calls is not None:
            calls.append(excess)
        k = Knobs.from_kwargs(precision=precision, **(knobs or NEW))
        return build_runner(model, OptimizerRecipe(opt), k, plan=plan or Plan(k))
    return replan


def guarded(r: Runner, replan) -> Runner:
    """``r``'s components in a Runner with ``replan`` (as ``fit`` builds it)."""
    return Runner(r.model, r.optimizer, plan=r.plan, precision=r.precision,
                  accumulation=r.accumulation, loss_fn=r.loss_fn, scaler=r.scaler,
                  scheduler=r.scheduler, device_type=r.device_type, handles=r.handles,
                  contexts=r.contexts, replan=replan, applied=r.applied)


def train(runner, batch, steps=range(STEPS)):
    for k in steps:
        torch.manual_seed(k)
        runner.step(batch)
    return runner


def reference(switch_at, precision="fp32", new=None):
    """The uninterrupted run: the old plan for steps < ``switch_at``, then the new plan
    (keeping the old scaler, as the guard does)."""
    model, opt, batch, old = setup(precision)
    train(old, batch, range(switch_at))
    old.close()
    k = Knobs.from_kwargs(precision=precision, **(new or NEW))
    runner = build_runner(model, OptimizerRecipe(opt), k, plan=Plan(k))
    if switch_at > 0 and old.scaler is not None:
        runner.scaler = old.scaler
    return train(runner, batch, range(switch_at, STEPS))


def assert_same_state(a: Runner, b: Runner):
    assert equal_params(a.model, b.model)
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for name in sa[i]:
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)
    if a.scaler is not None or b.scaler is not None:
        assert a.scaler.state_dict() == b.scaler.state_dict()


def inject_oom(module, on_calls):
    """A forward hook on ``module`` that raises ``memfit.OutOfMemory`` on the listed calls
    (counted from 1); records whether gradients already existed then."""
    seen = {"calls": 0, "grads_existed": []}

    def hook(m, args, out):
        seen["calls"] += 1
        if on_calls == "all" or seen["calls"] in on_calls:
            seen["grads_existed"].append(any(p.grad is not None for p in m.parameters()))
            raise memfit.OutOfMemory(requested_bytes=3000, live_bytes=9000, budget_bytes=10000,
                                     op="injected")
    return module.register_forward_hook(hook), seen


@pytest.mark.parametrize("precision,oom_step", [
    ("fp32", 0),        # the first step: the reference is the new plan from the start
    ("fp32", 1),        # optimizer state exists; the old plan ran step 0
    ("fp16", 1),        # GradScaler: its scale and growth counter carry over
])
def test_injected_oom_recovers_bitwise(precision, oom_step):
    model, opt, batch, r = setup(precision)
    calls = []
    runner = guarded(r, replanner(r, precision, calls))
    # the old plan calls block 1 twice per step (2 micro-batches): fail in the second one
    _, seen = inject_oom(model.transformer.h[1], on_calls={2 * oom_step + 2})
    train(runner, batch)
    assert seen["grads_existed"] == [True]     # the first micro-batch's gradients were there
    assert calls == [2000]                     # live + requested - budget of the error
    assert runner.plan.knobs.micro_batch_size == 1 and runner.last_step.micro_batches == 4
    assert_same_state(runner, reference(oom_step, precision))


def device_track(budget=None):
    """``memfit.track`` of every CPU storage, without ``model``: with one, its module watch
    (torch's ModTracker) hangs multi-grad hooks on the forward's tensors that also keep the
    graph of a forward that raised alive (its backward never runs)."""
    return memfit.track(device="cpu", budget=budget)


def peak_of(knobs) -> int:
    """The tracked peak of a whole STEPS-step run with ``knobs`` (no budget)."""
    _, _, batch, runner = setup(**knobs)
    with device_track() as t:
        train(runner, batch)
    return t.peak_bytes


def test_real_oom_under_a_tracked_budget_recovers():
    """``memfit.track(budget=b)`` with b between the new plan's peak and the old plan's: the
    old plan runs out of memory in a real op, the guard re-plans, and the run then stays
    within b and ends where the uninterrupted run ends."""
    old_peak, new_peak = peak_of(OLD), peak_of(NEW)
    assert new_peak < old_peak
    budget = (old_peak + new_peak) // 2
    model, opt, batch, r = setup()
    calls = []
    runner = guarded(r, replanner(r, calls=calls))
    switch_at = None
    with device_track(budget) as t:
        for k in range(STEPS):
            torch.manual_seed(k)
            runner.step(batch)
            if calls and switch_at is None:
                switch_at = k
    assert len(calls) == 1 and calls[0] > 0      # one re-plan, for what the op was over by
    assert switch_at is not None
    assert t.online_peak_bytes <= budget
    assert_same_state(runner, reference(switch_at))


def with_step_budget(runner, budget_bytes, step_bytes) -> Runner:
    runner.plan = dataclasses.replace(runner.plan, predicted_optimizer_step_bytes=step_bytes)
    runner.applied = dataclasses.replace(runner.applied, budget_bytes=budget_bytes)
    return runner


def snapshot_state(runner):
    return copy.deepcopy((list(runner.model.parameters()), runner.optimizer.state_dict()))


def assert_state_is(runner, saved):
    params, opt_state = saved
    assert all(torch.equal(p, q) for p, q in zip(runner.model.parameters(), params, strict=True))
    now = runner.optimizer.state_dict()["state"]
    for i, st in opt_state["state"].items():
        for name, v in st.items():
            assert torch.equal(now[i][name], v), (i, name)


def test_optimizer_step_that_cannot_fit_raises_before_it_runs():
    model, opt, batch, runner = setup()
    train(runner, batch, range(1))                      # optimizer state exists
    budget = 10_000_000
    with_step_budget(runner, budget, step_bytes=budget)   # live + step > budget, always
    saved = snapshot_state(runner)
    with memfit.track(model, opt) as t:
        with pytest.raises(memfit.OutOfMemory) as err:
            torch.manual_seed(1)
            runner.step(batch)
    assert err.value.op == "optimizer.step" and err.value.requested_bytes == budget
    # the live bytes are the tracker's: at least parameters, gradients and AdamW's 2 moments
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    assert state_bytes <= err.value.live_bytes <= t.peak_bytes
    assert_state_is(runner, saved)
    # without a tracker on the CPU nothing counts live bytes: the check is skipped
    train(runner, batch, range(1, 2))


def test_optimizer_step_check_hands_over_to_the_guard():
    model, opt, batch, r = setup()
    train(r, batch, range(1))
    with_step_budget(r, 10_000_000, step_bytes=10_000_000)
    calls = []
    k = Knobs.from_kwargs(precision="fp32", **NEW)
    fitting = Plan(k, budget_bytes=10_000_000, predicted_optimizer_step_bytes=1_000_000)
    runner = guarded(r, replanner(r, calls=calls, plan=fitting))
    with memfit.track(model, opt):
        train(runner, batch, range(1, STEPS))
    assert len(calls) == 1 and calls[0] > 0
    assert runner.plan is fitting
    assert_same_state(runner, reference(1))


def test_gives_up_after_max_retries_with_state_intact():
    model, opt, batch, r = setup("fp16")
    train(r, batch, range(1))
    calls = []
    runner = guarded(r, replanner(r, "fp16", calls))
    hook, _ = inject_oom(model.transformer.h[1], on_calls="all")
    saved = snapshot_state(runner)
    scaler_state = runner.scaler.state_dict()
    torch.manual_seed(1)
    rng = torch.get_rng_state()
    with pytest.raises(memfit.OutOfMemory) as err:
        runner.step(batch)
    assert len(calls) == 3
    notes = "\n".join(err.value.__notes__)
    assert "gave up after 3 re-plans" in notes and "micro_batch_size=2" in notes
    assert_state_is(runner, saved)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    assert runner.scaler.state_dict() == scaler_state
    hook.remove()                                       # the runner still trains
    runner.step(batch)
    assert runner.last_step.micro_batches == 4


def test_oom_inside_the_optimizer_step_is_not_retried():
    """The step may have updated some parameters already: rerunning would update them twice."""
    model, opt, batch, r = setup()
    calls = []
    runner = guarded(r, replanner(r, calls=calls))

    def fail(*args):
        raise memfit.OutOfMemory(requested_bytes=1, live_bytes=1, budget_bytes=1, op="injected")
    opt.register_step_pre_hook(fail)
    with pytest.raises(memfit.OutOfMemory) as err:
        runner.step(batch)
    assert calls == []
    assert "from inside the optimizer step" in "\n".join(err.value.__notes__)


@pytest.mark.slow
def test_guard_is_off_under_ddp_and_says_so(tmp_path):
    from tests.runtime import _oom_guard_worker
    from tests.runtime.test_distributed import free_port

    torch.multiprocessing.spawn(_oom_guard_worker.run, args=(2, free_port(), str(tmp_path)),
                                nprocs=2, join=True)
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert any(line.startswith("OOM guard off") for line in r["reasons"])
        assert r["error"] == "OutOfMemory" and r["replans"] == 0
        assert any("OOM guard off" in note for note in r["notes"])


def _hooks(model):
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


@pytest.mark.slow
def test_a_failed_replan_leaves_the_runner_as_it_was():
    """Note 5, under a real ``track(budget)``: a batch 4x as long as the one planned for runs
    out of memory; re-planning for what is then left of the budget fails. The runner must keep
    its plan and techniques (before: they were removed and it trained on without them, so the
    planned batch itself no longer fit) and stop with one OutOfMemory that says so."""
    model, short = tiny("gpt2", batch_size=4, seq_len=16)
    _, long = tiny("gpt2", batch_size=4, seq_len=64)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    twin = copy.deepcopy(model)
    plain = memfit.fit(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2), short,
                       micro_batch_size=4)
    train(plain, short, range(1))
    with device_track() as t:
        train(plain, short, range(1, 2))
    budget = int(t.peak_bytes * 0.9)            # the whole batch at once only fits recomputed
    runner = memfit.fit(model, opt, short, budget=budget, micro_batch_size=4,
                        offload_optimizer=False)
    assert any(m != "keep" for m in runner.applied.blocks.values())
    with device_track(budget):
        train(runner, short, range(2))
    plan, applied, optimizer, hooks = runner.plan, runner.applied, runner.optimizer, _hooks(model)
    saved = snapshot_state(runner)
    torch.manual_seed(2)
    rng = torch.get_rng_state()
    with device_track(budget):
        with pytest.raises(memfit.OutOfMemory) as err:
            runner.step(long)
    notes = "\n".join(err.value.__notes__)
    assert "did not fit" in notes and "re-planning failed" in notes
    assert f"budget {memfit.units.format_bytes(budget)}" in notes
    assert isinstance(err.value.__cause__, Exception)
    assert err.value.budget_bytes == budget and err.value.live_bytes > 0
    assert (runner.plan, runner.applied, runner.optimizer) == (plan, applied, optimizer)
    assert runner.plan is plan and runner.applied is applied and runner.optimizer is optimizer
    assert _hooks(model) == hooks
    assert_state_is(runner, saved)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    with device_track(budget) as t:             # it still trains the planned batch in budget
        train(runner, short, range(2, 3))
    assert t.peak_bytes <= budget


@pytest.mark.parametrize("failure", ["raises", "another model"])
def test_any_failed_replan_puts_the_techniques_back(failure):
    # Note 5 with a checkpointed runner: re-planning that raises, or that returns a Runner over
    # another model (adopt refuses it), leaves the checkpoint hooks on the blocks.
    model, opt, batch, r = setup(**dict(OLD, checkpoint="all"))
    other, _ = tiny("gpt2", batch_size=4, seq_len=16)

    def replan(excess):
        if failure == "raises":
            raise memfit.BudgetTooSmall("nothing fits", floor_bytes=2, budget_bytes=1)
        k = Knobs.from_kwargs(precision="fp32", **NEW)
        return build_runner(other, OptimizerRecipe(opt), k, plan=Plan(k))
    runner = guarded(r, replan)
    inject_oom(model.transformer.h[1], on_calls={2})
    hooks = _hooks(model)
    assert any(h == (1, 1) for h in hooks)        # checkpoint's pair on each block
    with pytest.raises(memfit.OutOfMemory) as err:
        runner.step(batch)
    assert "re-planning failed" in "\n".join(err.value.__notes__)
    assert type(err.value.__cause__) is (memfit.BudgetTooSmall if failure == "raises"
                                         else ValueError)
    assert _hooks(model) == hooks and set(_hooks(other)) == {(0, 0)}
    assert runner.plan is r.plan and runner.applied is r.applied
