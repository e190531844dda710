"""DTR (memfit.remat): exact training under budgets, the smallest budget, threshold-free mode.

Oracles: ``torch.equal`` on every parameter after seeded steps against the plain step (dropout
on); ``memfit.track`` with the same budget, which raises the moment live bytes would cross it.
"""

import hashlib
import logging

import pytest
import torch
from torch import nn

import memfit
from memfit import zoo
from memfit.step import canonical_step
from memfit.techniques._remat_units import Unit
from memfit.techniques.remat import Remat, RematBudgetTooSmall
from tests.helpers import equal_params

LAYERS = {"gpt2": "n_layer", "llama-1b": "num_hidden_layers", "bert-base": "num_hidden_layers"}


def build(name, batch_size=4, seq_len=64, layers=6):
    spec = zoo.get(name)
    model = spec.build(tiny=True, seed=0, **{LAYERS[name]: layers})
    model.train()                                    # dropout on: RNG must be replayed
    return model, spec.make_batch(model, batch_size, seq_len=seq_len, seed=0)


def plain_peak(model, batch, autocast=None):
    """Peak of a steady-state plain step (a copy of the model, so the caller's is untouched)."""
    import copy
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    canonical_step(m, opt, batch, autocast=autocast() if autocast else None)
    with memfit.track(m, opt) as t:
        canonical_step(m, opt, batch, autocast=autocast() if autocast else None)
    return t.peak_bytes


def train(net, batches, budget=None, remat=True, autocast=None, remat_budget=None,
          **remat_kwargs):
    """One seeded SGD step per batch; with ``remat`` under ``track(budget)`` +
    ``remat(remat_budget)``. Returns the model and the sessions' stats."""
    model = net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = []
    for k, batch in enumerate(batches):
        torch.manual_seed(k)
        ac = autocast() if autocast else None
        if not remat:
            canonical_step(model, opt, batch, autocast=ac)
            continue
        with memfit.track(model, opt, budget=budget), \
                memfit.remat(remat_budget, **remat_kwargs) as s:
            canonical_step(model, opt, batch, autocast=ac)
        stats.append(s.stats)
    return model, stats


BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [None, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(LAYERS))
def test_bitwise_equal_to_the_plain_step_under_a_budget(arch, autocast):
    model, batch = build(arch)
    ref, _ = train(build(arch)[0], [batch, batch], remat=False, autocast=autocast)
    budget = plain_peak(model, batch, autocast) * 6 // 10
    got, stats = train(model, [batch, batch], budget=budget, autocast=autocast, model=model)
    assert all(s.evictions > 0 and s.recomputes > 0 for s in stats), stats
    assert equal_params(ref, got)


def test_rng_replay_is_what_keeps_dropout_exact(monkeypatch):
    model, batch = build("gpt2")
    ref, _ = train(build("gpt2")[0], [batch], remat=False)
    monkeypatch.setattr(Unit, "_replay_rng", False)
    got, stats = train(model, [batch], budget=plain_peak(model, batch) * 6 // 10)
    assert stats[0].recomputes > 0 and not equal_params(ref, got)


def _feasible(budget) -> bool:
    try:
        train(build("gpt2")[0], [build("gpt2")[1]], budget=budget)
        return True
    except RematBudgetTooSmall:
        return False


def _digest(model) -> list[bytes]:
    """The parameters' bytes, hashed: bitwise comparison without keeping tensors alive (a
    remat budget counts every tensor alive, remat Note 8)."""
    return [hashlib.sha256(p.detach().numpy().tobytes()).digest() for p in model.parameters()]


# Opt-in for now: a CPU remat budget counts every storage alive in the process (remat Note 8),
# so after other tests in one process the bisected floor can sit ~22 KB (peak/256) too low for
# the loop's runs (seen in a suite run, not alone); open in the issue 11 closing note.
@pytest.mark.slow
def test_smallest_budget_holds_every_budget_above_it_and_below_it_a_clear_error():
    model, batch = build("gpt2")
    peak = plain_peak(model, batch)
    del model
    lo, hi = 0, peak                                  # bisection: hi always feasible
    while hi - lo > peak // 256:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _feasible(mid) else (mid, hi)
    print(f"gpt2 6x64, batch 4x64: plain peak {peak} B, smallest remat budget {hi} B "
          f"({hi / peak:.1%})")
    assert hi < peak // 2          # DTR reaches well under the plain step's peak
    ref = _digest(train(build("gpt2")[0], [batch], remat=False)[0])
    for k in range(9):             # every budget from the floor up: track never raises
        b = hi + (peak - hi) * k // 8
        net = build("gpt2")[0]
        got, _ = train(net, [batch], budget=b, remat_budget=b, model=net)
        assert _digest(got) == ref, b
        del net, got
    model, batch = build("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    canonical_step(model, opt, batch)                 # optimizer state exists
    params = [p.detach().clone() for p in model.parameters()]
    state = [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    with pytest.raises(RematBudgetTooSmall) as err:
        with memfit.track(model, opt, budget=lo), memfit.remat(model=model):
            canonical_step(model, opt, batch)
    e = err.value
    assert isinstance(e, memfit.BudgetTooSmall) and isinstance(e, memfit.OutOfMemory)
    assert e.budget_bytes == lo and e.floor_bytes > lo
    assert str(lo) in str(e) and str(e.floor_bytes) in str(e) and "checkpoint" in str(e)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    now = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    assert all(torch.equal(a, b) for a, b in zip(now, state))


def test_remat_budget_alone_keeps_live_bytes_under_it():
    model, batch = build("bert-base")
    budget = plain_peak(model, batch) // 2     # of this model alone: nothing else is alive
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for k in range(2):
        torch.manual_seed(k)
        with memfit.track(model, opt) as t:             # measures only: no budget here
            with memfit.remat(budget, model=model, optimizer=opt) as s:
                canonical_step(model, opt, batch)
        # the outer counter sees every op's outputs: remat evicted before an op that would
        # pass its budget, from the op's meta kernel (remat Note 6), so none was refused
        assert s.stats.evictions > 0 and s.stats.ahead > 0 and s.stats.retries == 0
        assert t.peak_bytes <= budget
    ref, _ = train(build("bert-base")[0], [batch, batch], remat=False)
    assert equal_params(ref, model)


def test_threshold_free_on_cpu_evicts_only_at_the_track_budget():
    model, batch = build("llama-1b")
    ref, _ = train(build("llama-1b")[0], [batch, batch], remat=False)
    budget = plain_peak(model, batch) * 6 // 10
    with pytest.raises(memfit.OutOfMemory):           # the plain step does not fit
        _plain_under(budget)
    got, stats = train(model, [batch, batch], budget=budget)    # remat() without budget or model
    assert all(s.evictions > 0 for s in stats) and equal_params(ref, got)
    _, free = train(build("llama-1b")[0], [batch], budget=None)  # no pressure: nothing evicted
    assert free[0].evictions == 0 and free[0].units == 6


def _plain_under(budget):
    model, batch = build("llama-1b")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memfit.track(model, opt, budget=budget):
        canonical_step(model, opt, batch)


def test_varying_lengths_need_no_planning_and_a_short_batch_evicts_nothing():
    model, long = build("bert-base", seq_len=64)
    short = zoo.get("bert-base").make_batch(model, 4, seq_len=8, seed=1)
    mid = zoo.get("bert-base").make_batch(model, 4, seq_len=40, seed=2)
    budget = plain_peak(model, long) * 6 // 10
    batches = [long, short, mid, long]
    ref, _ = train(build("bert-base")[0], batches, remat=False)
    got, stats = train(model, batches, budget=budget, model=model)
    assert [s.evictions > 0 for s in stats] == [True, False, False, True]
    assert equal_params(ref, got)


class _WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        x.mul_(1.0)                # an in-place write of its input: not recomputable
        return self.lin(torch.tanh(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.blocks = nn.ModuleList(_WritesInput() for _ in range(4))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_a_block_that_writes_its_input_is_refused_and_reported(caplog):
    caplog.set_level(logging.DEBUG, logger="memfit.remat")
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(256, 64)
    loss_fn = lambda m, b: m(b).square().mean()  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with memfit.track(model, opt) as t:
        canonical_step(model, opt, x, loss_fn)
    with pytest.raises(RematBudgetTooSmall, match="refused: blocks.0: its forward writes input 0"):
        with memfit.track(model, opt, budget=t.peak_bytes * 7 // 10), \
                memfit.remat(model=model) as s:
            canonical_step(model, opt, x, loss_fn)
    done = s.stats.units - 1                          # the last one was still running
    assert done >= 2 and s.stats.evictions == 0
    assert set(s.stats.refused) == {f"blocks.{i}" for i in range(done)}
    assert "block blocks.0 refused: its forward writes input 0 in place" in caplog.text


def test_session_hooks_blocks_without_patching_and_counts_what_it_cannot_evict():
    model, batch = build("gpt2")
    with memfit.remat() as s:                         # the model is found at its first call
        out = model(**batch)
        assert all("forward" not in vars(m) for m in model.modules())
        assert all(len(model.transformer.h[i]._forward_hooks) == 1 for i in range(6))
    out.loss.backward()
    assert all("forward" not in vars(m) and not m._forward_hooks and not m._forward_pre_hooks
               for m in model.modules())
    # outside every block: the embeddings' and the head's saves; a block's saves are not
    with memfit.track(model) as t:
        model(**batch)
    blocks = sum(r.saved_bytes for n, r in t.modules.items() if r.is_block)
    assert s.stats.units == 6 and 0 < s.stats.outside_blocks_bytes < blocks


def test_config_is_checked():
    with pytest.raises(ValueError, match="budget_bytes"):
        Remat.Config(budget_bytes=0)
    with pytest.raises(ValueError, match="sample_size"):
        Remat.Config(sample_size=-1)
    with pytest.raises(ValueError, match="blocks"):
        Remat.Config(blocks=["a"])
