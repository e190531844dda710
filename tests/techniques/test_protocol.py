"""Every technique speaks one protocol (docs/techniques/README.md): a frozen ``Config``
and an ``apply`` that returns a ``Change`` whose ``remove()`` takes off every hook it registered
and gives the model back its forward, to the bit (oracle: the same model's hooks, loss, logits
and gradients before ``apply``).

The techniques are discovered from the package's modules, not listed, so a new one cannot skip
these tests: it fails until it is exported from ``memfit.techniques`` and has a case in
``APPLY`` (how to apply it with a ``Config`` that does something)."""

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from transformers import GPT2Config, GPT2LMHeadModel

import memfit.techniques as techniques
from memfit.modes import Mode
from memfit.optimizers import OptimizerRecipe
from memfit.techniques import (Accumulation, Change, Checkpoint, LowBitOptimizer, Offload,
                               OptimizerOffload, PackedInt4, ParamOffload, Precision, QuantizedBase,
                               Remat,
                               Sharding)


def _discovered() -> dict[str, type]:
    """Every class with a nested ``Config`` defined in a public module of the package."""
    out = {}
    for info in pkgutil.iter_modules(techniques.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{techniques.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and \
                    inspect.isclass(getattr(obj, "Config", None)):
                out[name] = obj
    return out


TECHNIQUES = _discovered()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


# how each technique is applied, with a Config that changes something; bf16-pure is not here:
# it casts the weights in place, which remove() does not undo (docs/techniques/README.md)
APPLY = {
    "Accumulation": lambda m: Accumulation(Accumulation.Config(micro_batch_size=1)).apply(m),
    "Checkpoint": lambda m: Checkpoint(Checkpoint.Config("all")).apply(m),
    "ChunkedLoss": lambda m: techniques.ChunkedLoss(techniques.ChunkedLoss.Config(chunks=5))
    .apply(m),
    "Offload": lambda m: Offload(Offload.Config("all", min_bytes=0)).apply(m),
    "ParamOffload": lambda m: ParamOffload(ParamOffload.Config("all")).apply(m, _adamw(m)),
    "OptimizerOffload": lambda m: OptimizerOffload(OptimizerOffload.Config()).apply(m, _adamw(m)),
    # SGD at lr 0: the hooks step every weight in backward and leave it as it was (p - 0 * g),
    # so the forward after remove() is the one before
    "OptimizerInBackward": lambda m: techniques.OptimizerInBackward(
        techniques.OptimizerInBackward.Config()).apply(m, torch.optim.SGD(m.parameters(), lr=0.0)),
    "Precision": lambda m: Precision(Precision.Config("bf16")).apply(m,
                                                                     OptimizerRecipe(_adamw(m))),
    "LowBitOptimizer": lambda m: LowBitOptimizer(LowBitOptimizer.Config("8bit")).apply(
        m, OptimizerRecipe(_adamw(m))),
    "Remat": lambda m: Remat(Remat.Config()).apply(m, _adamw(m)),
    # DDP over a real gloo group of one rank (_one_rank): its all-reduce leaves the gradients
    # as they are, so the wrapper's step is the model's to the bit; FSDP2 shards in place,
    # which nothing undoes (techniques.sharding Note 4)
    "Sharding": lambda m: Sharding(Sharding.Config(kind="ddp")).apply(
        m, init_device_mesh("cpu", (1,))),
    "QuantizedBase": lambda m: QuantizedBase(QuantizedBase.Config(
        "nf4", compute_dtype="fp32")).apply(m.transformer.h.requires_grad_(False) and m),
    "PackedInt4": lambda m: PackedInt4(PackedInt4.Config(group_size=32)).apply(
        m.transformer.h.requires_grad_(False) and m),
}
# what these change stays changed (techniques._protocol Note 2: the float weights are gone):
# remove() takes off nothing, and the forward stays the applied one
IN_PLACE = {"QuantizedBase", "PackedInt4"}


@pytest.fixture(autouse=True)
def _one_rank(request):
    """A real gloo default group of one rank around the Sharding case, destroyed after it."""
    if "Sharding" not in request.node.name:
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():       # CPU: no pinned memory (each technique's own tests)
        warnings.filterwarnings("ignore", message="(Offload|OptimizerOffload):",
                                category=UserWarning)
        yield


def _model() -> nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                      n_positions=16))


def _step(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Loss, logits and gradients of one forward and backward (dropout seeded)."""
    ids = torch.arange(2 * 12).reshape(2, 12) % 64
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logits.detach(), grads


def _hooks(model: nn.Module) -> list:
    """The keys of every module and parameter hook on ``model``."""
    return [(name, tuple(m._forward_pre_hooks), tuple(m._forward_hooks),
             tuple(m._backward_pre_hooks), tuple(m._backward_hooks))
            for name, m in model.named_modules()] + \
        [(n, tuple(p._post_accumulate_grad_hooks)) for n, p in model.named_parameters()
         if getattr(p, "_post_accumulate_grad_hooks", None)]    # a packed weight is no parameter


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and len(a[2]) == len(b[2]) and \
        all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[2], b[2]))


def test_every_technique_is_exported_and_has_a_case():
    assert "Change" in techniques.__all__
    exported = {n for n in techniques.__all__ if n != "Change"}
    assert set(TECHNIQUES) == exported, "export each technique from memfit.techniques"
    assert set(TECHNIQUES) == set(APPLY), \
        "add a case to APPLY: how to apply the new technique with a Config that changes something"


@pytest.mark.parametrize("name", sorted(TECHNIQUES))
def test_config_is_a_frozen_dataclass(name):
    config = TECHNIQUES[name].Config()          # every field has a default
    assert dataclasses.is_dataclass(config)
    first = dataclasses.fields(config)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, first, getattr(config, first))


@pytest.mark.parametrize("name", sorted(TECHNIQUES))
def test_apply_returns_a_change_whose_remove_restores_the_forward_bitwise(name):
    model = _model()
    before, hooks = _step(model), _hooks(model)
    change = APPLY[name](model)
    assert (_hooks(model) != hooks) == bool(change.hooks)
    assert isinstance(change, Change) and isinstance(change.model, nn.Module)
    assert all(isinstance(n, str) for n in change.notes)
    assert all(isinstance(m, Mode) for m in change.modes.values())
    assert not change.optimizer_rebuilt or change.optimizer is not None or \
        change.recipe is not None
    with change.context() if change.context is not None else contextlib.nullcontext():
        applied = _step(change.model)          # the technique's hooks run once
    if name in IN_PLACE:
        change.remove()
        assert _hooks(model) == hooks and _same(applied, _step(model))
        return
    change.remove()
    change.remove()                            # a second remove does nothing more
    assert _hooks(model) == hooks and _same(before, _step(model))
    again = change.reapply()
    assert isinstance(again, Change) and again.modes == change.modes
    _step(again.model)
    again.remove()
    assert _hooks(model) == hooks and _same(before, _step(model))
