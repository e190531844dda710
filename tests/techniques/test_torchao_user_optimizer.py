"""A user's own torchao optimizer (``optimizer=torchao.optim.AdamW8bit(...)``, ``AdamWFp8``,
``AdamW4bit``, ``_AdamW``; the HF Trainer's ``optim="adamw_torch_4bit"``), estimated
(techniques._torchao_optimizer Notes 1-3).

The estimate traces torchao's step compiled, as torchao runs it (techniques._torchao_user).
Oracles, none of them memfit's counter: a real step of torchao's own class, compiled by torchao
(C++ built by gcc), measured by the CPU allocator's own events in a fresh process
(tests/trace/_compiled_oracle.py), for the estimate, to the byte; torchao's own eager functions
(``single_param_adam`` on torchao's own state subclasses, whose ``copy_`` quantizes inside
``__torch_dispatch__``) for the unrolled eager step memfit runs on the host, bitwise; the state
torchao's own class creates (``_new_buffer``; after a real compiled step in the slow tier) and
a hand count of its layout for the state bytes."""

import math

import pytest
import torch
from torch import nn

import memfit
from memfit.step import canonical_step
from memfit.techniques._torchao_optimizer import is_torchao
from memfit.techniques._torchao_user import rebuild_torchao
from tests.live_bytes import _storages
from tests.trace._compiled_oracle import measured_in_fresh_process, torchao_job

ao = pytest.importorskip("torchao.optim")
ao_adam = pytest.importorskip("torchao.optim.adam")

LOSS = lambda m, b: nn.functional.mse_loss(m(b[0]), b[1])      # noqa: E731

# class name -> keywords a user might pass (a block size of their own, coupled decay, amsgrad:
# torchao's own step runs it only on unquantized moments, as _AdamW's always are)
USERS = {
    "AdamW8bit": {"weight_decay": 0.1},
    "AdamWFp8": {"weight_decay": 0.1, "block_size": 128},
    "Adam8bit": {"weight_decay": 0.01, "block_size": 128},
    "AdamFp8": {},
    "AdamW4bit": {"block_size": 256},
    "_AdamW": {"weight_decay": 0.05, "amsgrad": True},
}


def _mlp(seed=0):
    """Weights of 16,384 values (quantized by torchao's rule), biases of 256 and 64 (not)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def _batch():
    torch.manual_seed(1)
    return (torch.randn(16, 64), torch.randn(16, 64))


def _state_bytes(optimizer) -> int:
    """Bytes of every storage the optimizer's state holds (a subclass: its inner tensors)."""
    seen = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                for st in _storages(v):
                    seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _hand_state(params, cls: str, block_size: int, amsgrad: bool = False) -> int:
    """torchao's layout, by hand: a tensor of at least 4096 values that the block divides holds
    per moment 1 byte per value (8-bit codes, fp8), or half a byte (4-bit codes packed two a
    byte), an fp32 scale per block and, 8 and 4 bits, its map (256 or 16 fp32 values); any
    other tensor (and every one of ``_AdamW``, which quantizes none) moments in its own dtype;
    each a 4-byte fp32 step."""
    moments = 3 if amsgrad else 2
    total = 0
    for p in params:
        n = p.numel()
        total += 4
        if n >= 4096 and n % block_size == 0 and cls != "_AdamW":
            code = n // 2 if "4bit" in cls else n
            qmap = {"8bit": 256 * 4, "4bit": 16 * 4}.get(cls[-4:], 0)
            total += moments * (code + n // block_size * 4 + qmap)
        else:
            total += moments * n * p.element_size()
    return total


@pytest.mark.parametrize("name", USERS)
def test_the_unrolled_step_is_torchaos_eager_step_bitwise(name):
    """Oracle: torchao's ``single_param_adam`` run eagerly on the state torchao's class makes
    (its compiled form cannot run under a dispatch mode: _torchao_optimizer Note 1); the user's
    block size, amsgrad and weight decay kept by the rebuild. ``lr`` a float on both sides (the
    rebuilt optimizer keeps it one)."""
    cls, kw = getattr(ao, name), USERS[name]
    a, b = _mlp(), _mlp()
    ours = rebuild_torchao(cls(a.parameters(), lr=1e-2, **kw),
                           {id(p): p for p in a.parameters()})
    theirs = cls(b.parameters(), lr=1e-2, **kw)
    assert ours.block_size == theirs.block_size and type(ours).__bases__[1] is cls
    x = torch.randn(8, 64)
    for _ in range(3):
        for m in (a, b):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        ours.step()
        for g in theirs.param_groups:
            for p in g["params"]:
                s = theirs.state[p]
                if not s:
                    s.update(step=torch.tensor(0.0), exp_avg=theirs._new_buffer(p, True),
                             exp_avg_sq=theirs._new_buffer(p, False))
                    if g["amsgrad"]:
                        s["max_exp_avg_sq"] = theirs._new_buffer(p, False)
                s["step"] += 1
                ao_adam.single_param_adam(p.detach(), p.grad, s["step"], s["exp_avg"],
                                          s["exp_avg_sq"], s.get("max_exp_avg_sq"),
                                          float(g["lr"]), *g["betas"], g["weight_decay"],
                                          g["eps"], theirs.is_adamw, False)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    state = ours.state[a[0].weight]
    assert {type(v).__name__ for v in state.values()} == \
        {type(v).__name__ for v in theirs.state[b[0].weight].values()}
    assert _state_bytes(ours) == _state_bytes(theirs)


def _check_compiled(name: str, kw: dict) -> object:
    """The estimate of a user's torchao optimizer is torchao's compiled step, to the byte but
    for torchao's ``lr``: a 0-d fp32 tensor per param group that the user's instance keeps on
    the host (the measured run is all on the CPU), where the trace reads it as a float."""
    job = {"torchao": name, "kw": kw}
    model, batch, loss_fn, user = torchao_job(job)
    est = memfit.estimate(memfit.Job(model, batch, optimizer=user, loss_fn=loss_fn))
    measured = measured_in_fresh_process(job)  # torchao's own class, compiled
    assert est.peak_bytes == measured - 4 * len(user.param_groups)
    assert any("torchao's step traced compiled" in n for n in est.notes)
    assert est.breakdown["optimizer"] == _hand_state(
        list(model.parameters()), name, kw.get("block_size", 128 if "4bit" in name else 256),
        kw.get("amsgrad", False))
    return est, measured


def test_estimate_of_a_users_torchao_optimizer_is_its_compiled_step():
    """4 bits (the largest eager temporaries: int64 codes) in the default tier, with torchao's
    block size; the slow tier runs the others. memfit's own 4-bit lever steps the same state
    eagerly (``optimizer_state="4bit"``: torchao's class, every op at the top), and must hold
    more at its peak, or the compiled trace is not what was measured."""
    est, measured = _check_compiled("AdamW4bit", {})
    model, batch, loss_fn, _ = torchao_job({"torchao": "AdamW4bit"})
    lever = memfit.estimate(memfit.Job(model, batch, optimizer="adamw", loss_fn=loss_fn),
                            optimizer_state="4bit")
    assert lever.breakdown["optimizer"] == est.breakdown["optimizer"]
    assert lever.peak_bytes > measured


@pytest.mark.slow
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8", "Adam8bit", "AdamW4bit", "_AdamW"])
def test_estimate_of_each_torchao_optimizer_is_its_compiled_step(name):
    _check_compiled(name, USERS[name])


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8", "AdamW4bit", "_AdamW"])
def test_state_is_what_torchaos_own_class_makes(name):
    """Oracle: the state torchao's own class creates at its first step (``_new_buffer`` for
    each moment and a 0-d fp32 step), made here without stepping (its step compiles: the slow
    test below steps it). ``_AdamW`` keeps its moments in the parameters' dtype (bf16 here)."""
    model, batch = _mlp(), _batch()
    if name == "_AdamW":
        model = model.to(torch.bfloat16)
        batch = tuple(t.to(torch.bfloat16) for t in batch)
    kw = {"bf16_stochastic_round": True} if name == "_AdamW" else USERS[name]
    user = getattr(ao, name)(model.parameters(), lr=1e-3, **kw)
    est = memfit.estimate(memfit.Job(model, batch, optimizer=user, loss_fn=LOSS))
    for g in user.param_groups:
        for p in g["params"]:
            user.state[p].update(step=torch.tensor(0.0), exp_avg=user._new_buffer(p, True),
                                 exp_avg_sq=user._new_buffer(p, False))
    assert est.breakdown["optimizer"] == _state_bytes(user)
    assert is_torchao(user)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
def test_state_after_torchaos_real_compiled_step(name):
    """Slow (torch.compile builds C++ with gcc on CPU: minutes): the state of torchao's own
    class after its real compiled step equals the estimate's; the default tier compares the
    state its ``_new_buffer`` makes (above)."""
    model, batch = _mlp(), _batch()
    user = getattr(ao, name)(model.parameters(), lr=1e-3, **USERS[name])
    est = memfit.estimate(memfit.Job(model, batch, optimizer=user, loss_fn=LOSS))
    canonical_step(model, user, batch, LOSS)
    assert est.breakdown["optimizer"] == _state_bytes(user)


def test_factory_and_refusals():
    """A factory making a torchao optimizer is rebuilt the same way (its block size kept);
    torchao's optimizer with ``optimizer_state`` set is refused with the fix."""
    model, batch = _mlp(), _batch()
    factory = lambda ps: ao.AdamW8bit(ps, lr=1e-3, block_size=128)      # noqa: E731
    est = memfit.estimate(memfit.Job(model, batch, optimizer=factory, loss_fn=LOSS))
    assert est.breakdown["optimizer"] == _hand_state(list(model.parameters()), "AdamW8bit", 128)
    with pytest.raises(ValueError, match="already torchao's AdamW8bit.*leave optimizer_state"):
        memfit.estimate(memfit.Job(model, batch, optimizer=factory, loss_fn=LOSS),
                        optimizer_state="4bit")


def test_hf_trainers_adamw_torch_4bit():
    """optim="adamw_torch_4bit": transformers builds torchao's ``AdamW4bit`` with
    ``block_size=256`` (its ``optim_args`` default), in two param groups (decay and not). The
    state by hand, with that block size: before, the trace stopped in torchao's maps."""
    from memfit.integrations import transformers as mf_hf
    from tests.integrations.hf_helpers import tiny_trainer

    trainer = tiny_trainer("gpt2", optim="adamw_torch_4bit")
    est = mf_hf.estimate(trainer)
    params = list({id(p): p for p in trainer.model.parameters()}.values())
    assert est.breakdown["optimizer"] == _hand_state(params, "AdamW4bit", 256)
    assert math.prod(params[0].shape) % 256 == 0        # the embedding is quantized too
