"""``memfit.remat(budget=b)`` on models it was never tuned on: the budget holds by an
independent count, the blocks are found without being told, the user's modules are untouched.

Oracle: ``LiveBytes``, a dispatch mode of this file (not memfit's ledger) that sums
``untyped_storage().nbytes()`` of every live storage through weak references: seeded with the
parameters, buffers, gradients, optimizer state and batch alive before the step, then every
tensor an op reads or returns. It is entered *outside* remat, so it sees every op's outputs,
even those of an op remat's CPU counter would refuse after the fact (remat evicts before such
an op runs: its Note 6). Exactness: ``torch.equal`` on every parameter against the plain step,
dropout on.
Models: transformers' GPT-Neo and DistilBERT at tiny sizes with random weights (not in
``memfit.zoo``, so nothing was tuned on them).
"""

import contextlib
import gc
import logging
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import memfit
from memfit.step import canonical_step
from memfit.techniques.remat import RematBudgetTooSmall
from tests.helpers import foreign_bytes

transformers = pytest.importorskip("transformers")


class LiveBytes(TorchDispatchMode):
    """Live storage bytes, counted by weak references to each storage (independent oracle)."""

    def __init__(self, roots=()):
        super().__init__()
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.current_bytes = self.peak_bytes = 0
        for t in roots:
            self._add(t)

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or st.nbytes() == 0:
            return
        self.live[key] = (st.nbytes(), weakref.ref(st, lambda _, k=key: self._drop(k)))
        self.current_bytes += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _drop(self, key) -> None:
        self.current_bytes -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for x in tree_flatten((args, kwargs))[0]:
            self._add(x)
        out = func(*args, **kwargs)
        for x in tree_flatten(out)[0]:
            self._add(x)
        return out


def roots(model, opt, batch) -> list:
    """Every tensor of the job alive before a step: parameters, buffers, grads, state, batch."""
    out = list(model.parameters()) + list(model.buffers())
    out += [p.grad for p in model.parameters() if p.grad is not None]
    out += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return out + [v for v in batch.values() if torch.is_tensor(v)]


def gpt_neo():
    cfg = transformers.GPTNeoConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                                    attention_types=[[["global", "local"], 2]],
                                    max_position_embeddings=128, window_size=16,
                                    bos_token_id=0, eos_token_id=0)
    return transformers.GPTNeoForCausalLM(cfg), 4


def distilbert():
    cfg = transformers.DistilBertConfig(vocab_size=512, dim=64, hidden_dim=256, n_layers=4,
                                        n_heads=4, max_position_embeddings=128)
    return transformers.DistilBertForMaskedLM(cfg), 4


MODELS = {"gpt-neo": gpt_neo, "distilbert": distilbert}


def job(arch, steps_before=1):
    """A seeded tiny model in train mode (dropout on), AdamW, a 4x64 batch, ``steps_before``
    plain steps (so optimizer state exists)."""
    torch.manual_seed(0)
    model, layers = MODELS[arch]()
    model.train()
    ids = torch.randint(0, 512, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(steps_before):
        torch.manual_seed(100 + k)
        canonical_step(model, opt, batch)
    return model, opt, batch, layers


def plain(arch, steps_before=1, steps=1):
    """(the oracle's peak of the plain steps, the parameters after them)."""
    model, opt, batch, _ = job(arch, steps_before)
    oracle = LiveBytes(roots(model, opt, batch))
    with oracle:
        for k in range(steps):
            torch.manual_seed(k)
            canonical_step(model, opt, batch)
    return oracle.peak_bytes, [p.detach().clone() for p in model.parameters()]


def under_remat(arch, budget, steps_before=1, steps=1, given=False, in_track=False):
    """The same steps in one ``remat(budget)`` session (inside ``track(budget=budget)`` with
    ``in_track``): (oracle peak, stats, parameters)."""
    model, opt, batch, _ = job(arch, steps_before)
    oracle = LiveBytes(roots(model, opt, batch))
    kw = {"model": model, "optimizer": opt} if given else {}
    session_budget = budget + foreign_bytes(roots(model, opt, batch))
    outer = memfit.track(budget=budget) if in_track else contextlib.nullcontext()
    with oracle, outer, memfit.remat(session_budget, **kw) as s:
        for k in range(steps):
            torch.manual_seed(k)
            canonical_step(model, opt, batch)
    return oracle.peak_bytes, s.stats, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", list(MODELS))
def test_the_one_line_session_keeps_the_budget_by_an_independent_count(arch, caplog):
    caplog.set_level(logging.WARNING, logger="memfit.remat")
    peak = plain(arch)[0]
    budget = peak * 7 // 10
    measured, stats, got = under_remat(arch, budget)       # no model, no optimizer named
    print(f"{arch}: plain {peak} B, budget {budget} B, measured {measured} B "
          f"({measured / budget - 1:+.1%}), {stats.evictions} evictions")
    assert stats.evictions > 0 and stats.recomputes > 0 and stats.ahead > 0
    assert measured <= budget
    assert stats.units == MODELS[arch]()[1]                # each block call once: found alone
    assert "no repeated blocks" not in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(plain(arch)[1], got))


def test_an_enclosing_track_budget_does_not_stand_in_for_remats_own_count():
    peak = plain("gpt-neo")[0]
    budget = peak * 7 // 10          # track(budget) without a model counts from first use
    measured, stats, got = under_remat("gpt-neo", budget, in_track=True)
    assert stats.evictions > 0 and measured <= budget
    assert all(torch.equal(a, b) for a, b in zip(plain("gpt-neo")[1], got))


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MODELS))
def test_state_the_first_step_creates_inside_the_session_is_within_the_budget(arch):
    peak = plain(arch, steps_before=0, steps=2)[0]
    budget = peak * 7 // 10
    for given in (False, True):
        measured, stats, got = under_remat(arch, budget, steps_before=0, steps=2, given=given)
        assert stats.evictions > 0 and measured <= budget, (given, measured, budget)
        assert all(torch.equal(a, b) for a, b in zip(plain(arch, 0, 2)[1], got))


def test_the_user_modules_are_never_patched_and_gradients_stay_bitwise():
    arch = "gpt-neo"
    model, opt, batch, _ = job(arch)
    hooks_before = {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks))
                    for m in model.modules()}
    budget = plain(arch)[0] * 7 // 10 + foreign_bytes(roots(model, opt, batch))
    with memfit.remat(budget) as s:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = model(**batch)
        assert all("forward" not in vars(m) for m in model.modules())    # during
        out.loss.backward()
        del out
    assert s.stats.evictions > 0 and s.stats.recomputes > 0
    assert all("forward" not in vars(m) for m in model.modules())        # after
    assert hooks_before == {id(m): (len(m._forward_pre_hooks), len(m._forward_hooks))
                            for m in model.modules()}
    assert s.model is None                   # the session keeps nothing of the model alive
    ref, ropt, _, _ = job(arch)
    ropt.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    ref(**batch).loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()))


def test_a_budget_below_what_is_alive_on_entry_is_refused_with_the_numbers():
    model, opt, batch, _ = job("distilbert")
    gc.collect()
    with pytest.raises(RematBudgetTooSmall, match="already alive when the session opens") as e:
        with memfit.remat(1 << 20):
            canonical_step(model, opt, batch)
    assert e.value.floor_bytes > 1 << 20 and str(e.value.floor_bytes) in str(e.value)
    assert all("forward" not in vars(m) for m in model.modules())
