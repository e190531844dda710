"""One floor, the true least (issue 11 items 3 and 9).

The floor is the least device memory of any configuration in the search space, re-traced
(api._planner Note 4). The oracle, traced here one by one: every assignment of keep / recompute /
offload to the two blocks of a tiny GPT-2 at micro-batch 1 and 2 with the optimizer state on
the host, the uniform modes (selective too) with it on the device, keep / recompute with the
block weights on the host too (issue 15), every assignment with the gradients moved to the
host in backward and with the optimizer stepped in backward, and all of them with the loss in
pieces (issue 28). (The least is a mixed
one: the last block's backward follows its forward at once, so recomputing it saves nothing
at the peak.) The floor must be their minimum, and the same number in
``Plan.floor_bytes``, ``explain()`` and ``BudgetTooSmall.floor_bytes``; a budget of exactly
the floor plans, one byte less raises.
"""

import importlib
import itertools

import pytest
import torch

import memfit
from memfit.planner.variants import CHUNKED_LOSS
from memfit.units import format_bytes
from tests.helpers import tiny

UNIFORM = [dict(checkpoint="none"), dict(checkpoint="all"), dict(checkpoint="selective"),
           dict(offload="all")]


def _mixed(blocks):
    for modes in itertools.product(("keep", "recompute", "offload"), repeat=len(blocks)):
        rec = tuple(n for n, m in zip(blocks, modes) if m == "recompute")
        off = tuple(n for n, m in zip(blocks, modes) if m == "offload")
        yield dict(checkpoint=rec or "none", offload=off or "none")


def _brute_force(model, batch, b):
    blocks = memfit.estimate(model, batch).blocks
    configs = [dict(offload_optimizer=True, **c) for c in _mixed(blocks)]
    configs += [dict(offload_optimizer=False, **c) for c in UNIFORM]
    # the block weights on the host (issue 15): with the optimizer there, no activation offload
    configs += [dict(offload_optimizer=True, offload_params="all", checkpoint=c["checkpoint"])
                for c in _mixed(blocks) if c["offload"] == "none"]
    # the gradients moved to the host in backward (issue 28): with the optimizer there
    configs += [dict(offload_optimizer=True, offload_gradients=True, **c) for c in _mixed(blocks)]
    sizes = [dict(micro_batch_size=m, **c) for m in range(1, b + 1) for c in configs]
    # the optimizer stepped in backward: the whole batch, its state on the device
    sizes += [dict(micro_batch_size=b, optimizer_in_backward=True, **c) for c in _mixed(blocks)]
    # and each with the loss in pieces (a causal LM's, issue 28)
    sizes += [dict(chunked_loss=CHUNKED_LOSS, **c) for c in sizes]
    return min(memfit.estimate(model, batch, **c).device_bytes for c in sizes)


@pytest.mark.slow      # 15-60 s each: the CI time limit (a lighter sibling stays)
def test_floor_is_the_least_traced_configuration_everywhere():
    model, batch = tiny("gpt2", batch_size=2, seq_len=32)
    del batch["attention_mask"]     # all ones: the plan would count it held (api._planner Note 3)
    least = _brute_force(model, batch, 2)
    quick = memfit.plan(model, batch)              # the plain step fits: no floor traced
    assert quick.floor_bytes is None and "floor" not in quick.explain()
    free = memfit.plan(model, batch, floor=True)              # asked for
    assert free.floor_bytes == least
    assert format_bytes(least) in free.explain()
    at = memfit.plan(model, batch, budget=least, floor=True)  # exactly the floor: plans
    assert at.predicted_device_bytes <= least and at.floor_bytes == least
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=least - 1)
    assert info.value.floor_bytes == least
    assert format_bytes(least) in str(info.value)


@pytest.mark.slow
def test_budget_too_small_names_freezing_and_lora_with_numbers():
    """Parameters + gradients + optimizer state alone over the budget: the error says what
    the weights alone need and that freezing / LoRA removes the rest (item 9)."""
    model, batch = tiny("gpt2", batch_size=2, seq_len=32)
    params = sum(p.numel() * p.element_size() for p in model.parameters())   # fp32, AdamW
    budget = int(1.5 * params)     # below weights + gradients + two Adam moments (4x)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=budget)
    text = str(info.value)
    assert "LoRA" in text and "requires_grad=False" in text
    assert f"the weights alone need {format_bytes(params)}" in text
    assert format_bytes(3 * params) in text          # gradients + optimizer state


def test_a_qlora_job_is_not_told_to_train_lora_or_quantize_its_base():
    """Already LoRA on a 4-bit base: the refusal offers fewer adapters, not LoRA, and no QLoRA
    line (it counted the adapters as the linear layers to quantize)."""
    peft = pytest.importorskip("peft")
    from memfit.techniques.quantized_base import QuantizedBase

    model, batch = tiny("gpt2", batch_size=2, seq_len=32)
    model.requires_grad_(False)
    QuantizedBase(QuantizedBase.Config(kind="nf4")).apply(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                       task_type=peft.TaskType.CAUSAL_LM))
    t4 = memfit.devices.get_device("t4")         # 64 KiB beside the CUDA context
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=t4.cuda_context_bytes + 2 ** 16, device=t4)
    text = str(info.value)
    assert "a lower LoRA rank or fewer target modules" in text
    assert "train LoRA adapters" not in text and "QLoRA" not in text


@pytest.mark.slow      # 13-23 s each: the CI time limit (a lighter sibling stays)
def test_a_frozen_model_plans_smaller():
    """requires_grad=False: no gradient and no optimizer state, so the floor (optimizer state
    on the host there, the gradients held on the device) falls by at least the frozen part's
    gradients (its bytes, fp32)."""
    model, batch = tiny("gpt2", batch_size=2, seq_len=32)
    fixed = dict(offload_params="none", offload_gradients=False)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=1, floor=True, **fixed)
    full_floor = info.value.floor_bytes
    frozen = [p for n, p in model.named_parameters() if ".h." in n]
    for p in frozen:
        p.requires_grad_(False)
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
    p = memfit.plan(model, batch, budget=full_floor - 1, floor=True, **fixed)
    assert p.floor_bytes <= full_floor - frozen_bytes


# --- the floor's lower bound, before any trace (issue 26 item 15, _floor Note 5) ----------

def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    batch = {"x": torch.randn(4, 64)}
    return model, batch, (lambda m, b: m(b["x"]).pow(2).mean())


def _no_trace(monkeypatch):
    def traced(*args, **kwargs):
        raise AssertionError("traced")
    for name in ("memfit.api._planner", "memfit.api._plan_parts"):     # where plans trace
        monkeypatch.setattr(importlib.import_module(name), "estimate", traced)


def test_a_budget_under_the_weights_bound_is_refused_before_any_trace(monkeypatch):
    """Every lever open (CPU, fp32): the gradients alone stay on the device (the weights and
    the state may go to the host), so the bound is 4 B per weight, counted here by hand."""
    model, batch, loss = _mlp()
    grads = sum(4 * p.numel() for p in model.parameters())
    _no_trace(monkeypatch)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=grads - 1, loss_fn=loss)
    assert info.value.floor_is_bound and info.value.floor_bytes == grads
    text = str(info.value)
    assert "needs at least " + format_bytes(grads) in text and "freeze parameters" in text
    assert len(text.splitlines()) >= 4 and " B:" not in text          # lines, no raw bytes
    with pytest.raises(AssertionError, match="traced"):     # one byte more: on to the trace
        memfit.plan(model, batch, budget=grads, loss_fn=loss)


def test_the_bound_with_levers_fixed_counts_weights_gradients_and_adam_state(monkeypatch):
    """Weights and state held on the device by the caller: weights + gradients + AdamW's two
    fp32 moments and its 4-byte step per parameter, by hand; a GPU adds its CUDA context."""
    model, batch, loss = _mlp()
    numel = sum(p.numel() for p in model.parameters())
    n = len(list(model.parameters()))
    need = 4 * numel + 4 * numel + 8 * numel + 4 * n
    _no_trace(monkeypatch)
    # the optimizer in backward left open, one gradient (the largest) is all it must hold
    in_backward = need - 4 * numel + 4 * max(p.numel() for p in model.parameters())
    fixed = dict(offload_optimizer=False, offload_params="none", loss_fn=loss)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=in_backward - 1, **fixed)
    assert info.value.floor_bytes == in_backward
    fixed["optimizer_in_backward"] = False
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=need - 1, **fixed)
    assert info.value.floor_bytes == need
    with pytest.raises(AssertionError, match="traced"):
        memfit.plan(model, batch, budget=need, **fixed)
    gpu = memfit.devices.get_device("gtx-1080-ti")
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=need + gpu.cuda_context_bytes - 1, device=gpu,
                    precision="fp32", **fixed)
    assert info.value.floor_bytes == need + gpu.cuda_context_bytes
    assert "CUDA context alone" not in str(info.value)      # the levers are named
    # a budget the CUDA context alone fills: said so, and not the levers (none can help)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=gpu.cuda_context_bytes, device=gpu, precision="fp32",
                    **fixed)
    said = str(info.value)
    assert "The CUDA context alone" in said and "Beyond memfit's levers" not in said
    assert f"give a budget above {format_bytes(gpu.cuda_context_bytes)}" in said


@pytest.mark.slow
@pytest.mark.parametrize("fixed", [{}, dict(offload_optimizer=False, offload_params="none")])
def test_the_bound_is_never_above_the_traced_floor(fixed):
    """The bound is a lower bound of the same floor: the traced floor is at least it, and a
    budget at the bound goes on to the trace (which then plans or refuses with the floor)."""
    model, batch, loss = _mlp()
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=1, loss_fn=loss, **fixed)
    bound = info.value.floor_bytes
    assert info.value.floor_is_bound
    floor = memfit.plan(model, batch, loss_fn=loss, floor=True, **fixed).floor_bytes
    assert bound <= floor
    try:
        memfit.plan(model, batch, budget=bound, loss_fn=loss, **fixed)
    except memfit.BudgetTooSmall as e:
        assert not e.floor_is_bound and e.floor_bytes == floor


def test_an_integer_budget_without_its_unit_is_refused_at_once_with_the_unit_named():
    """Issue 26 item 16: ``budget=11`` is 11 bytes (an int counts bytes, and a tiny model's
    budget computed from an estimate is an honest int under 1 MiB); meant as 11 GiB it is
    refused before any trace, by the parameters-alone bound, with the unit to write."""
    spec = memfit.zoo.get("gpt2")
    model = spec.build(tiny=True)
    batch = spec.make_batch(model, 2, seq_len=32)
    with pytest.raises(memfit.BudgetTooSmall) as info:
        memfit.plan(model, batch, budget=11)
    assert info.value.floor_is_bound                # refused by the bound: nothing traced
    assert "budget='11GiB'" in str(info.value) and "11 bytes" in str(info.value)
    with pytest.raises(memfit.BudgetTooSmall) as info:   # a unit given: no such hint
        memfit.plan(model, batch, budget="11KiB")
    assert "integer budget" not in str(info.value) and "11.00 KiB" in str(info.value)


def test_an_fp16_refusal_on_a_gpu_is_a_budget_error():
    """The refusal's line on several GPUs searches layouts only for what a sharded step runs
    (fp32, bf16): with fp16 fixed it is left out, instead of the layout search raising
    "precision='fp16' with sharding" in place of ``BudgetTooSmall``."""
    model, batch = tiny("gpt2", batch_size=2, seq_len=16)
    with pytest.raises(memfit.BudgetTooSmall):
        memfit.plan(model, batch, budget=1, device="gtx-1080-ti", precision="fp16", floor=True)
