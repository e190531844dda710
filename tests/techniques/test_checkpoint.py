"""Checkpoint: recompute changes where bytes live, never the math (bitwise oracles)."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

import memfit
from memfit.measure import find_blocks
from memfit.step import canonical_step
from memfit.techniques.checkpoint import Checkpoint, _BlockHooks
from memfit.trace.cuda_autocast import CudaAutocastMode
from tests.helpers import equal_params, tiny, train_seeded

MODELS = ("gpt2", "bert-base", "llama-1b")
BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)   # noqa: E731


def _policy(policy, model):
    # "last": a tuple naming the model's last block
    return (find_blocks(model)[-1],) if policy == "last" else policy


@pytest.mark.parametrize("autocast", [None, BF16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("policy", ["all", "every:2", "selective", "last"])
@pytest.mark.parametrize("name", MODELS)
def test_two_steps_bitwise_equal(name, policy, autocast):
    plain, batch = tiny(name)
    wrapped, _ = tiny(name)
    handle = Checkpoint(Checkpoint.Config(_policy(policy, wrapped))).apply(wrapped)
    assert any(m != "keep" for m in handle.modes.values())
    train_seeded(plain, batch, autocast=autocast)
    train_seeded(wrapped, batch, autocast=autocast)
    assert equal_params(plain, wrapped)


def test_without_rng_replay_dropout_differs(monkeypatch):
    # Negative control: the same hooks recomputing without replaying the RNG draw new dropout
    # masks in backward, so the oracle above would catch a missing replay.
    plain, batch = tiny("gpt2")
    wrapped, _ = tiny("gpt2")
    Checkpoint(Checkpoint.Config("all")).apply(wrapped)
    monkeypatch.setattr(_BlockHooks, "preserve_rng_state", False)
    train_seeded(plain, batch)
    train_seeded(wrapped, batch)
    assert not equal_params(plain, wrapped)


def _tracked_step(model, batch):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    canonical_step(model, opt, batch)
    with memfit.track(model, opt) as t:
        canonical_step(model, opt, batch)
    return t


def test_all_lowers_peak_and_activations():
    plain, batch = tiny("gpt2", batch_size=4, seq_len=64)
    wrapped, _ = tiny("gpt2", batch_size=4, seq_len=64)
    Checkpoint(Checkpoint.Config("all")).apply(wrapped)
    base, ckpt = _tracked_step(plain.train(), batch), _tracked_step(wrapped.train(), batch)
    assert ckpt.peak_bytes < base.peak_bytes
    assert ckpt.breakdown["activations"] < base.breakdown["activations"]


def _step_flops(model, batch):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with FlopCounterMode(display=False) as fc:
        canonical_step(model, opt, batch)
    return fc.get_total_flops()


# FLOPs of the block forwards that non-reentrant checkpoint's early stop skips (see below).
_SKIPPED_BY_EARLY_STOP = {"gpt2": (), "bert-base": (), "llama-1b": ("mlp.down_proj",)}


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-replay"])
@pytest.mark.parametrize("policy", ["all", "every:2"])
@pytest.mark.parametrize("name", MODELS)
def test_recompute_flops(name, policy, early_stop):
    # The extra FLOPs of a checkpointed step are the recomputed blocks' forward FLOPs, measured
    # per module (FlopCounterMode.get_flop_counts) in a plain forward of the same batch.
    # Non-reentrant checkpoint reruns the block's forward in backward and, with early stop (the
    # default), stops as soon as the last tensor the block saved for backward is repacked.
    # Autograd packs an op's saved *inputs* before the kernel runs, so a matmul that saves only
    # its inputs and feeds no later saving op never runs again. That is llama's last op,
    # down_proj (mm saves its input; the residual add after it saves nothing): each recompute
    # costs the block's forward minus down_proj, 2*48*128*64 = 786432 FLOPs less. gpt2's block
    # ends with c_proj -> dropout (which saves its mask, an output) and bert's with dense ->
    # LayerNorm (which saves its input), so their recompute is the full block forward. Without
    # early stop every block recomputes its full forward.
    plain, batch = tiny(name)
    wrapped, _ = tiny(name)
    handle = Checkpoint(Checkpoint.Config(policy)).apply(wrapped)
    recomputed = [n for n, m in handle.modes.items() if m == "recompute"]
    plain.train()
    wrapped.train()
    with FlopCounterMode(display=False) as fc:
        plain(**batch)
    flops = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    prefix = type(plain).__name__
    skipped = _SKIPPED_BY_EARLY_STOP[name] if early_stop else ()
    expected = sum(flops[f"{prefix}.{n}"] - sum(flops[f"{prefix}.{n}.{s}"] for s in skipped)
                   for n in recomputed)
    assert expected > 0
    with set_checkpoint_early_stop(early_stop):
        extra = _step_flops(wrapped, batch) - _step_flops(plain, batch)
    assert extra == expected


@pytest.mark.parametrize("name", MODELS)
def test_selective_recomputes_no_matmul(name):
    # Note 3: every FLOP-counted op (mm/addmm/bmm/SDPA) is in SAVED_OPS, so the selective
    # recompute reruns only FLOP-free ops: the step's FLOPs are the plain step's, exactly.
    plain, batch = tiny(name)
    wrapped, _ = tiny(name)
    Checkpoint(Checkpoint.Config("selective")).apply(wrapped)
    assert _step_flops(wrapped.train(), batch) == _step_flops(plain.train(), batch)


def test_caches_are_not_written_twice():
    # Note 5: T5's decoder blocks get an EncoderDecoderCache; kept, the recompute would find the
    # cross-attention cache filled, skip its projections and raise CheckpointError.
    plain, batch = tiny("t5-base")
    wrapped, _ = tiny("t5-base")
    Checkpoint(Checkpoint.Config("all")).apply(wrapped)
    assert equal_params(train_seeded(plain, batch), train_seeded(wrapped, batch))


def test_transformers_own_checkpointing_is_an_error():
    model, _ = tiny("llama-1b")
    enable = getattr(model, "activation_checkpointing_enable", None)   # transformers >= 5
    (enable or model.gradient_checkpointing_enable)()
    with pytest.raises(ValueError, match="checkpointing_disable"):
        Checkpoint(Checkpoint.Config("all")).apply(model)


def test_remove_restores_the_model():
    model, batch = tiny("bert-base")
    twin, _ = tiny("bert-base")
    blocks = [model.get_submodule(n) for n in find_blocks(model)]
    originals = [b.forward for b in blocks]
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    hooks = [(dict(b._forward_pre_hooks), dict(b._forward_hooks)) for b in blocks]
    handle = Checkpoint(Checkpoint.Config("all")).apply(model)
    # Note 1: module hooks, nothing replaced on the instance
    assert all("forward" not in vars(b) and b.forward == f for b, f in zip(blocks, originals))
    assert all(len(b._forward_pre_hooks) == len(b._forward_hooks) == 1 for b in blocks)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    handle.remove()
    assert all("forward" not in vars(b) and b.forward == f for b, f in zip(blocks, originals))
    assert [(dict(b._forward_pre_hooks), dict(b._forward_hooks)) for b in blocks] == hooks
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    assert equal_params(train_seeded(model, batch), train_seeded(twin, batch))
    Checkpoint(Checkpoint.Config("all")).apply(model)    # wrapping again is allowed after remove


def test_a_users_own_instance_forward_is_kept_and_recomputed():
    # The recompute calls whatever forward the block has when it runs (Note 1): here the
    # user's own instance forward, which counts its calls (forward, then the recompute).
    model, batch = tiny("gpt2")
    twin, _ = tiny("gpt2")
    block = model.get_submodule(find_blocks(model)[0])
    own, calls = block.forward, []
    block.forward = lambda *a, **k: calls.append(1) or own(*a, **k)
    mine = vars(block)["forward"]
    handle = Checkpoint(Checkpoint.Config("all")).apply(model)
    assert vars(block)["forward"] is mine
    model.train()
    model(**batch).loss.backward()
    assert len(calls) == 2
    handle.remove()
    assert vars(block)["forward"] is mine
    del vars(block)["forward"]
    assert equal_params(train_seeded(model, batch), train_seeded(twin, batch))


def test_user_hooks_run_once_outside_the_recompute():
    # A user's forward pre-hook that changes the input (x * 2) runs once per call, outside the
    # checkpointed region: the recompute reruns forward only, so gradients stay bitwise.
    plain, batch = tiny("gpt2")
    wrapped, _ = tiny("gpt2")
    calls = []

    def double(module, args, kwargs):
        calls.append(torch._C._current_graph_task_id() != -1)     # True: inside backward
        return (args[0] * 2, *args[1:]), kwargs

    for m in (plain, wrapped):
        m.get_submodule(find_blocks(m)[0]).register_forward_pre_hook(double, with_kwargs=True)
    Checkpoint(Checkpoint.Config("all")).apply(wrapped)
    assert equal_params(train_seeded(plain, batch), train_seeded(wrapped, batch))
    assert calls and not any(calls)


def test_deepcopy_of_a_wrapped_model_recomputes_its_own_blocks():
    model, batch = tiny("gpt2")
    Checkpoint(Checkpoint.Config("all")).apply(model)
    clone = copy.deepcopy(model)
    for n in find_blocks(model):
        block, copied = model.get_submodule(n), clone.get_submodule(n)
        assert "forward" not in vars(copied)
        (mine,), (theirs,) = (list(b._forward_pre_hooks.values()) for b in (block, copied))
        assert isinstance(theirs.__self__, _BlockHooks) and theirs.__self__ is not mine.__self__
    twin, _ = tiny("gpt2")
    assert equal_params(train_seeded(clone, batch), train_seeded(twin, batch))


def test_resolve_conventions():
    model, _ = tiny("llama-1b")
    blocks = find_blocks(model)
    assert Checkpoint(Checkpoint.Config()).resolve(model) == {b: "keep" for b in blocks}
    resolve = lambda policy: Checkpoint(Checkpoint.Config(policy)).resolve(model)   # noqa: E731
    assert resolve("every:2") == {blocks[0]: "keep", blocks[1]: "recompute"}
    assert resolve("every:1") == resolve("all") == {b: "recompute" for b in blocks}
    assert resolve("selective") == {b: "selective" for b in blocks}
    assert resolve((blocks[0],)) == {blocks[0]: "recompute", blocks[1]: "keep"}
    with pytest.warns(UserWarning, match="recomputes nothing"):
        assert "recompute" not in resolve("every:3").values()


@pytest.mark.parametrize("policy, match", [
    ("sometimes", "unknown"), ("every:0", ">= 1"), ("every:-2", ">= 1"), ("every:x", ">= 1"),
    ((), "at least one"), (["model.layers.0"], "not a list"),
])
def test_bad_config(policy, match):
    with pytest.raises(ValueError, match=match):
        Checkpoint.Config(policy)


def test_unknown_names_list_the_blocks():
    model, _ = tiny("llama-1b")
    with pytest.raises(ValueError, match=r"\['model.layer.0'\] match no submodule.*model.layers.0"):
        Checkpoint(Checkpoint.Config(("model.layer.0",))).apply(model)
    with pytest.raises(ValueError, match="unknown"):
        Checkpoint(Checkpoint.Config()).apply(model, {"model.layers.0": "offload"})


def test_apply_twice_is_an_error():
    model, _ = tiny("gpt2")
    Checkpoint(Checkpoint.Config("all")).apply(model)
    with pytest.raises(ValueError, match="already checkpointed.*remove"):
        Checkpoint(Checkpoint.Config("every:1")).apply(model)


def test_no_repeated_blocks_then_own_names():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1))
    twin = copy.deepcopy(model)
    no_blocks = "GradientCheckpointingLayer.*ModuleList/Sequential.*tuple"
    with pytest.raises(ValueError, match=no_blocks):
        Checkpoint(Checkpoint.Config("all")).resolve(model)
    Checkpoint(Checkpoint.Config(("1", "2"))).apply(model)
    x = torch.randn(4, 8)
    loss_fn = lambda m, b: m(b).square().mean()   # noqa: E731
    for m in (model, twin):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for k in range(2):
            torch.manual_seed(k)
            canonical_step(m, opt, x, loss_fn)
    assert equal_params(model, twin)


def _cuda_autocast_grads(model, batch):
    model.train()
    torch.manual_seed(0)
    with CudaAutocastMode(torch.bfloat16):
        loss = model(**batch).loss
    loss.backward()
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("policy", ["all", "selective"])
def test_cuda_autocast_recompute_reenters_the_mode(policy):
    plain, batch = tiny("bert-base")
    wrapped, _ = tiny("bert-base")
    Checkpoint(Checkpoint.Config(policy),
               autocast_factory=lambda: CudaAutocastMode(torch.bfloat16)).apply(wrapped)
    expected, got = _cuda_autocast_grads(plain, batch), _cuda_autocast_grads(wrapped, batch)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_cuda_autocast_without_factory_fails():
    # Why the factory exists (Note 4): the recompute runs outside the mode, in fp32.
    model, batch = tiny("bert-base")
    Checkpoint(Checkpoint.Config("all")).apply(model)
    with pytest.raises(CheckpointError):
        _cuda_autocast_grads(model, batch)


def test_no_grad_runs_the_block_as_is():
    model, batch = tiny("llama-1b")
    twin, _ = tiny("llama-1b")
    Checkpoint(Checkpoint.Config("all")).apply(model)
    with torch.no_grad():
        assert torch.equal(model.eval()(**batch).logits, twin.eval()(**batch).logits)
