"""A low-bit optimizer's phase traced with each kind of parameter's update run once
(``trace.per_parameter``, ``measure._repeats``).

The oracle is the whole step traced with the same knobs, whose optimizer phase runs every
update (repeats are allowed only in a trace of the optimizer phase alone): the phase alone must
give its ops, op costs, timeline and state, event for event. And the updates that ran must be
one per kind of parameter, not one per parameter, or the mechanism saved nothing.
"""

import pytest
import torch
import transformers

import memfit
from memfit.measure import track
from memfit.planner._trace_reads import level_before
from memfit.trace.per_parameter import repeats_allowed


def _neox(layers: int = 4):
    """A GPT-NeoX (in no test of the zoo) of width 64."""
    config = transformers.GPTNeoXConfig(hidden_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, intermediate_size=128,
                                        vocab_size=300, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.GPTNeoXForCausalLM(config)
    ids = torch.randint(0, 300, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def _kinds(model) -> int:
    return len({(tuple(p.shape), p.dtype) for p in model.parameters() if p.requires_grad})


def _phase(est, start: int) -> tuple:
    rise = [t - level_before(est, start) for t in est.timeline[start:]]
    return (est.op_log[start:], est.op_costs[start:], rise,
            level_before(est, start, "optimizer"))


CASES = [
    pytest.param("a100-80gb", dict(precision="bf16", optimizer_state="4bit"), "torchao.optim",
                 id="gpu-4bit"),
    pytest.param("cpu", dict(precision="fp32", optimizer_state="bf16"), "torchao.optim",
                 id="cpu-bf16-state"),
    pytest.param("gtx-1080-ti", dict(precision="fp16", optimizer_state="8bit",
                                     max_grad_norm=1.0), "bitsandbytes", id="gpu-fp16-8bit-clip"),
    pytest.param("cpu", dict(precision="fp32", optimizer_state="8bit"), "bitsandbytes",
                 id="cpu-8bit"),
]


@pytest.mark.parametrize("layers", [4, 16])
@pytest.mark.parametrize("device,knobs,library", CASES)
def test_the_phase_with_each_kind_updated_once_is_the_whole_steps(device, knobs, library,
                                                                    layers, monkeypatch):
    """4 layers: traced whole; 16: composed from twins of 5 and 4 layers (trace.block_reuse),
    the updates once per kind across both twins, the copies labelled by their parameter's
    block."""
    pytest.importorskip(library)
    model, batch = _neox(layers)
    whole = memfit.estimate(model, batch, device=device, allocator_replay=False,
                            compose_blocks=False, **knobs)
    ran = []
    if library == "bitsandbytes":      # what memfit's BnbStep calls, once per update run
        import bitsandbytes.optim.optimizer as bnb_optimizer
        real = bnb_optimizer.Optimizer2State.update_step
        monkeypatch.setattr(bnb_optimizer.Optimizer2State, "update_step",
                            lambda self, *a: ran.append(1) or real(self, *a))
    else:                              # what memfit's EagerStep calls, once per update run
        import memfit.techniques._torchao_optimizer as ao
        real = ao.unrolled_adam
        monkeypatch.setattr(ao, "unrolled_adam", lambda *a: ran.append(1) or real(*a))
    alone = memfit.estimate(model, batch, device=device, optimizer_only=True,
                            allocator_replay=False, **knobs)
    assert alone.traced_as.startswith("whole" if layers == 4 else "composed")
    assert _phase(alone, 0) == _phase(whole, whole.phases["optimizer"])
    assert alone.peak_bytes == max(alone.timeline)
    params = sum(p.requires_grad for p in model.parameters())
    # once per kind: in the whole model, or in twin A, whose updates twin B repeats
    # (trace.per_parameter Note 3)
    assert len(ran) == _kinds(model) < params


def test_a_plan_weighs_the_low_bit_states_from_the_phase_alone():
    """The planner models each low-bit state from its phase alone (api._plan_levers), now
    traced with repeats; under a budget only a low-bit state meets, its pick, verified by a
    whole trace, runs as predicted: the real CPU step measured by ``track``."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("torchao.optim")
    from tests.helpers import track_runner_step
    model, batch = _neox()
    with torch.device("cpu"):
        model = type(model)(model.config)
    plain = memfit.estimate(memfit.Job(model, batch), device="cpu")
    budget = plain.peak_bytes - plain.breakdown["optimizer"] // 2
    p = memfit.plan(memfit.Job(model, batch), device="cpu", budget=budget,
                    allow_numerics_change=True, offload_optimizer=False)
    assert p.knobs.optimizer_state in ("bf16", "8bit", "4bit")
    knobs = {k: v for k, v in p.knobs.to_dict().items() if v is not None}
    measured = track_runner_step(model, batch, "adamw", **knobs)
    assert measured.peak_bytes == p.predicted_peak_bytes <= budget


def test_a_real_run_updates_every_parameter_even_where_repeats_are_allowed():
    """Repeats are for a fake trace: a real step inside ``repeats_allowed`` (and inside
    ``track``) updates each parameter, bitwise as the same step outside."""
    pytest.importorskip("torchao.optim")
    from memfit.techniques.low_bit_optimizer import LowBitOptimizer

    def stepped(allowed: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)])
        opt = LowBitOptimizer(LowBitOptimizer.Config(state="4bit")).rebuild(
            torch.optim.AdamW(model.parameters(), lr=0.1))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()            # the state made, as a steady state's
        before = [p.detach().clone() for p in model.parameters()]
        with track(model, opt), repeats_allowed() if allowed else torch.no_grad():
            opt.step()
        after = [p.detach().clone() for p in model.parameters()]
        assert not any(torch.equal(a, b) for a, b in zip(before, after))   # each one moved
        return after

    got, expected = stepped(True), stepped(False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
