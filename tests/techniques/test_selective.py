"""Selective recompute on steps torch's own selective checkpoint refuses (issue 26, items 5 and 6).

The oracle everywhere: the same model without any checkpoint, the same seeded steps, and
``torch.equal`` on every gradient of every step (recompute changes where bytes live, never the
math). The models are written here after timm's EfficientNet-B0 blocks (``InvertedResidual`` with
``BatchNormAct2d`` and ``SqueezeExcite``, ``DropPath``), since timm needs torchvision.
"""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (checkpoint, create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)
from torch.utils.flop_counter import FlopCounterMode

import memfit
from memfit.techniques._selective import selective_contexts
from memfit.techniques.checkpoint import SAVED_OPS, Checkpoint
from tests.helpers import track_runner_step


class BatchNormAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: batch norm, then an in-place activation on its (new) output."""

    def __init__(self, channels: int, act: bool = True):
        super().__init__(channels)
        self.act = nn.SiLU(inplace=True) if act else nn.Identity()

    def forward(self, x):
        return self.act(super().forward(x))


class SqueezeExcite(nn.Module):
    """timm's ``SqueezeExcite``: ``act1`` is in place, straight on ``conv_reduce``'s output."""

    def __init__(self, channels: int, reduced: int, inplace: bool = True):
        super().__init__()
        self.conv_reduce = nn.Conv2d(channels, reduced, 1)
        self.act1 = nn.SiLU(inplace=inplace)
        self.conv_expand = nn.Conv2d(reduced, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x):
        s = self.act1(self.conv_reduce(x.mean((2, 3), keepdim=True)))
        return x * self.gate(self.conv_expand(s))


class DropPath(nn.Module):
    """timm's ``drop_path``: a per-sample Bernoulli mask scaled in place (RNG replayed)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class InvertedResidual(nn.Module):
    """timm's ``InvertedResidual`` (MBConv, stride 1, with skip): pw, dw, SE, pwl, drop path."""

    def __init__(self, channels: int, se_inplace: bool = True):
        super().__init__()
        mid = 4 * channels
        self.conv_pw = nn.Conv2d(channels, mid, 1, bias=False)
        self.bn1 = BatchNormAct(mid)
        self.conv_dw = nn.Conv2d(mid, mid, 3, padding=1, groups=mid, bias=False)
        self.bn2 = BatchNormAct(mid)
        self.se = SqueezeExcite(mid, channels // 4, se_inplace)
        self.conv_pwl = nn.Conv2d(mid, channels, 1, bias=False)
        self.bn3 = BatchNormAct(channels, act=False)
        self.drop_path = DropPath(0.2)

    def forward(self, x):
        shortcut = x
        x = self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))
        x = self.bn3(self.conv_pwl(self.se(x)))
        return self.drop_path(x) + shortcut


class EfficientNetish(nn.Module):
    def __init__(self, channels: int = 8, depth: int = 3, se_inplace: bool = True):
        super().__init__()
        self.conv_stem = nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False)
        self.bn1 = BatchNormAct(channels)
        self.blocks = nn.Sequential(*(InvertedResidual(channels, se_inplace)
                                      for _ in range(depth)))
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        x = self.blocks(self.bn1(self.conv_stem(x)))
        return self.head(x.mean((2, 3)))


def _build(seed=0, **kw):
    torch.manual_seed(seed)
    return EfficientNetish(**kw)


def _images(n=4):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


def _grads_of_steps(model, batch, loss=_ce, steps=2):
    """Every gradient of ``steps`` seeded SGD steps (the RNG seeded before each)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for k in range(steps):
        torch.manual_seed(k)
        opt.zero_grad(set_to_none=True)
        loss(model, batch).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _bitwise(a, b) -> bool:
    return all(torch.equal(x, y) for ga, gb in zip(a, b, strict=True)
               for x, y in zip(ga, gb, strict=True))


@pytest.mark.parametrize("policy", ["selective", ("blocks.0:selective", "blocks.2")])
def test_squeeze_excite_bitwise_equal(policy):
    # Item 5: SE's in-place SiLU mutates what conv_reduce returned, an output selective keeps.
    plain, wrapped, batch = _build(), _build(), _images()
    Checkpoint(Checkpoint.Config(policy)).apply(wrapped)
    assert _bitwise(_grads_of_steps(plain, batch), _grads_of_steps(wrapped, batch))


def _torch_selective(block, x):
    """``block(x)`` under torch's own selective checkpoint, keeping ``SAVED_OPS``."""
    keep = [op for packet in SAVED_OPS for op in (getattr(packet, o) for o in packet.overloads())]
    contexts = functools.partial(create_selective_checkpoint_contexts, keep)
    return checkpoint(block, x, use_reentrant=False, context_fn=contexts)


@pytest.mark.parametrize("se_inplace", [True, False])
def test_the_op_torch_refuses_is_se_act1(se_inplace):
    # Negative control for the test above: the block it trains is one torch's pair refuses, and
    # the op is SE's in-place act1 (BatchNormAct's in-place SiLU acts on batch norm's new output).
    block = InvertedResidual(8, se_inplace)
    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    loss = _torch_selective(block, x).sum()
    if se_inplace:
        with pytest.raises(RuntimeError, match="has been mutated"):
            loss.backward()
    else:
        loss.backward()


def test_a_mutated_output_is_not_kept():
    # _selective Note 2: the forward drops what was mutated (recomputed, never held twice) and
    # keeps the rest: conv_reduce's output goes, conv_expand's and every other conv's stay.
    se = SqueezeExcite(8, 2)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    forward, _ = selective_contexts(SAVED_OPS)
    with forward:
        se(x)
    kept = forward.kept[torch.ops.aten.convolution.default]
    assert kept[0] is None and kept[1] is not None


def _step_flops(model, batch) -> int:
    with FlopCounterMode(display=False) as fc:
        _grads_of_steps(model, batch, steps=1)
    return fc.get_total_flops()


def test_what_selective_reruns_is_the_mutated_conv():
    # The price of the drop, exactly: the selective step's FLOPs are the plain step's plus one
    # forward of each block's se.conv_reduce (measured per module in a plain forward), the only
    # kept op whose output is mutated; every other conv is handed back, not rerun.
    plain, wrapped, batch = _build(), _build(), _images()
    Checkpoint(Checkpoint.Config("selective")).apply(wrapped)
    with FlopCounterMode(display=False) as fc:
        plain(batch[0])
    per_module = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    reduce = sum(per_module[f"EfficientNetish.blocks.{i}.se.conv_reduce"] for i in range(3))
    assert reduce > 0
    assert _step_flops(wrapped, batch) - _step_flops(plain, batch) == reduce


def test_output_mutated_after_the_block():
    # The caller's relu_ on a block's output (a matmul's): without early stop the recompute
    # reaches that matmul, whose kept output now holds relu's values; it is rerun instead.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).relu_()
            return x.sum()

    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    wrapped = Net()
    Checkpoint(Checkpoint.Config("selective")).apply(wrapped)
    x = torch.randn(4, 16)
    loss = lambda model, batch: model(batch)   # noqa: E731
    with set_checkpoint_early_stop(False):
        assert _bitwise(_grads_of_steps(plain, x, loss), _grads_of_steps(wrapped, x, loss))


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
                                    for _ in range(3))
        self.out = nn.Linear(32, 1)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


def gradient_penalty(model, batch):
    """WGAN-GP's critic loss: a gradient taken with create_graph, then backward through it."""
    x = batch.clone().requires_grad_(True)
    score = model(x).mean()
    g, = torch.autograd.grad(score, x, create_graph=True)
    return -score + 10 * ((g.norm(dim=1) - 1) ** 2).mean()


@pytest.mark.parametrize("factory", [None, contextlib.nullcontext], ids=["", "recompute-ctx"])
@pytest.mark.parametrize("policy", ["all", "selective"])
def test_double_backward_bitwise_equal(policy, factory):
    # Item 6: the second backward recomputes the blocks again; with a recompute context (a
    # modelled autocast, checkpoint Note 4) that context is entered again too.
    torch.manual_seed(0)
    plain = Critic()
    torch.manual_seed(0)
    wrapped = Critic()
    Checkpoint(Checkpoint.Config(policy), autocast_factory=factory).apply(wrapped)
    x = torch.randn(8, 16)
    assert _bitwise(_grads_of_steps(plain, x, gradient_penalty),
                    _grads_of_steps(wrapped, x, gradient_penalty))


def gp_step(model, batch, optimizer):
    optimizer.zero_grad(set_to_none=True)
    loss = gradient_penalty(model, batch["x"])
    loss.backward()
    optimizer.step()
    return loss


def test_estimate_and_fit_run_double_backward():
    # Item 6 through the API (the user's step): the estimate equals the real step to the byte.
    torch.manual_seed(0)
    model, batch = Critic(), {"x": torch.randn(8, 16)}
    est = memfit.estimate(model, batch, "adamw", step=gp_step, checkpoint="selective")
    assert set(est.knobs_blocks.values()) == {"selective"}
    t = track_runner_step(model, batch, "adamw", step=gp_step, checkpoint="selective")
    assert t.peak_bytes == est.peak_bytes


def test_estimate_and_fit_run_squeeze_excite():
    # Item 5 through the API: estimate and fit ran into torch's refusal; now the estimate equals
    # the real step to the byte.
    model, batch = _build(), _images()
    est = memfit.estimate(model, batch, "adamw", loss_fn=_ce, checkpoint="selective")
    assert set(est.knobs_blocks.values()) == {"selective"}
    t = track_runner_step(model, batch, "adamw", loss_fn=_ce, checkpoint="selective")
    assert t.peak_bytes == est.peak_bytes
