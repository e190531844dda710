"""Each fidelity rule: the real CPU kernel beside the fake one, outputs' dtypes and sizes."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from memfit.trace.fidelity import FidelityMode


def shapes(out):
    return [(tuple(o.shape), o.dtype, o.untyped_storage().nbytes()) for o in out]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_norm_with_reduced_input_and_fp32_params(dtype):
    x = torch.randn(2, 4, 5, 5).to(dtype)
    w, b = torch.ones(4), torch.zeros(4)
    rm, rv = torch.zeros(4), torch.ones(4)
    args = (x, w, b, rm, rv, True, 0.1, 1e-5)
    real = torch.ops.aten.native_batch_norm.default(*args)
    fake_mode = FakeTensorMode()
    fargs = tuple(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with fake_mode:
        plain = torch.ops.aten.native_batch_norm.default(*fargs)
        with FidelityMode():
            fixed = torch.ops.aten.native_batch_norm.default(*fargs)
    assert shapes(plain) != shapes(real)        # the gap the rule exists for
    assert shapes(fixed) == shapes(real)


def test_batch_norm_in_one_dtype_is_left_alone():
    x = torch.randn(2, 4, 5, 5)
    args = (x, torch.ones(4), torch.zeros(4), torch.zeros(4), torch.ones(4), True, 0.1, 1e-5)
    real = torch.ops.aten.native_batch_norm.default(*args)
    fake_mode = FakeTensorMode()
    fargs = tuple(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with fake_mode, FidelityMode():
        fixed = torch.ops.aten.native_batch_norm.default(*fargs)
    assert shapes(fixed) == shapes(real)


def fake_args(fake_mode, args):
    return tuple(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)


def layout(t):
    return tuple(t.shape), t.stride(), t.dtype, t.untyped_storage().nbytes()


GROUPED = {  # (mat_a, mat_b) shapes: the forward (2D x 3D) and the two backward layouts
    "2d-3d": ((16, 16), (3, 16, 8)),
    "3d-2d": ((3, 16, 16), (16, 8)),
    "2d-2d": ((16, 16), (16, 8)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout_name", list(GROUPED))
def test_grouped_mm_in_fp32_and_fp16_follows_the_cpu_kernel(dtype, layout_name):
    """Rule 2: the meta function refuses non-bf16 inputs; the CPU kernel runs them."""
    sa, sb = GROUPED[layout_name]
    a, b = torch.randn(sa).to(dtype), torch.randn(sb).to(dtype)
    offs = torch.tensor([4, 8, 16], dtype=torch.int32)   # strides of 16 bytes: the CPU kernel's rule
    real = torch._grouped_mm(a, b, offs=offs)
    fake_mode = FakeTensorMode()
    fa, fb, foffs = fake_args(fake_mode, (a, b, offs))
    with fake_mode:
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(fa, fb, offs=foffs)
        with FidelityMode():
            fixed = torch._grouped_mm(fa, fb, offs=foffs)
    assert layout(fixed) == layout(real)


def test_grouped_mm_in_bf16_keeps_the_meta_function():
    a, b = torch.randn(12, 16).bfloat16(), torch.randn(3, 16, 8).bfloat16()
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offs)
    fake_mode = FakeTensorMode()
    with fake_mode, FidelityMode():
        fixed = torch._grouped_mm(*fake_args(fake_mode, (a, b)), offs=fake_mode.from_tensor(offs))
    assert layout(fixed) == layout(real)


def test_layer_norm_backward_gives_a_contiguous_grad_input_like_the_cpu_kernel():
    """Rule 3: a transposed grad_out (Swin's patch merging) used to give a transposed grad_input."""
    x = torch.randn(2, 8, 16)
    w, b = torch.randn(16), torch.randn(16)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [16], w, b, 1e-5)
    grad = torch.randn(2, 16, 8).transpose(1, 2)            # (2, 8, 16), not contiguous
    args = (grad, x, [16], mean, rstd, w, b, [True, True, True])
    real = torch.ops.aten.native_layer_norm_backward(*args)
    fake_mode = FakeTensorMode()
    fargs = fake_args(fake_mode, args)
    with fake_mode:
        plain = torch.ops.aten.native_layer_norm_backward(*fargs)
        with FidelityMode():
            fixed = torch.ops.aten.native_layer_norm_backward(*fargs)
    assert [layout(t) for t in plain] != [layout(t) for t in real]
    assert [layout(t) for t in fixed] == [layout(t) for t in real]


NORMS = {  # name -> (op, args builder(x dtype)): the affine parameters fp32, as under autocast
    "layer_norm": lambda d: (torch.ops.aten.native_layer_norm.default,
                             (torch.randn(2, 4, 6).to(d), [6], torch.ones(6), torch.zeros(6), 1e-5)),
    "layer_norm_weight_only": lambda d: (torch.ops.aten.native_layer_norm.default,
                                         (torch.randn(2, 4, 6).to(d), [6], torch.ones(6), None, 1e-5)),
    "layer_norm_no_params": lambda d: (torch.ops.aten.native_layer_norm.default,
                                       (torch.randn(2, 4, 6).to(d), [6], None, None, 1e-5)),
    "group_norm": lambda d: (torch.ops.aten.native_group_norm.default,
                             (torch.randn(2, 4, 3, 3).to(d), torch.ones(4), torch.zeros(4), 2, 4, 9, 2, 1e-5)),
    "group_norm_no_params": lambda d: (torch.ops.aten.native_group_norm.default,
                                       (torch.randn(2, 4, 3, 3).to(d), None, None, 2, 4, 9, 2, 1e-5)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", list(NORMS))
def test_layer_and_group_norm_statistics_dtype_like_the_cpu_kernel(norm, dtype):
    """Rule 4: a reduced input with fp32 parameters gets fp32 mean/rstd from the CPU kernel."""
    op, args = NORMS[norm](dtype)
    real = op(*args)
    fake_mode = FakeTensorMode()
    fargs = fake_args(fake_mode, args)
    with fake_mode, FidelityMode():
        fixed = op(*fargs)
    assert [layout(t) for t in fixed] == [layout(t) for t in real]


class _Recorder(TorchDispatchMode):
    """Every aten call of a real run whose outputs include a storage none of its inputs hold."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        held = {x.untyped_storage()._cdata for x in tree_flatten((args, kwargs))[0]
                if isinstance(x, torch.Tensor)}
        if any(isinstance(x, torch.Tensor) and x.untyped_storage()._cdata not in held
               for x in tree_flatten(out)[0]):
            self.calls.append((func, args, kwargs, out))
        return out


def _storage_bytes(out) -> list[int]:
    return [x.untyped_storage().nbytes() for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]


def _storage_gaps(fn, *inputs):
    """Run ``fn(*inputs)`` and its backward (into the first input) for real; replay each aten call on fakes under
    ``FidelityMode``; the calls whose new outputs' storage bytes differ (fake vs real)."""
    inputs = [inputs[0].requires_grad_(), *inputs[1:]]      # the prediction; targets have none
    with _Recorder() as rec:
        out = fn(*inputs)
        out.sum().backward()
    gaps = []
    for func, args, kwargs, out in rec.calls:
        fake_mode = FakeTensorMode()
        fargs, fkwargs = tree_map(lambda x: fake_mode.from_tensor(x) if isinstance(x, torch.Tensor)
                                  else x, (args, kwargs))
        with fake_mode, FidelityMode():
            fout = func(*fargs, **fkwargs)
        real, fake = (_storage_bytes(out), _storage_bytes(fout))
        if real != fake:
            gaps.append((str(func), real, fake))
    return gaps


def _x():
    return torch.rand(6, 5)


LOSSES = {  # name -> (fn(x, y, reduction=...), inputs): every loss of torch.nn.functional but CTC
    "mse": (F.mse_loss, lambda: (_x(), _x())),
    "mse_broadcast": (F.mse_loss, lambda: (_x(), torch.rand(5))),
    "l1": (F.l1_loss, lambda: (_x(), _x())),
    "smooth_l1": (F.smooth_l1_loss, lambda: (_x(), _x())),
    "smooth_l1_beta0": (lambda x, y, **kw: F.smooth_l1_loss(x, y, **kw, beta=0.0),
                        lambda: (_x(), _x())),
    "huber": (F.huber_loss, lambda: (_x(), _x())),
    "bce": (F.binary_cross_entropy, lambda: (_x(), _x())),
    "bce_weight": (lambda x, y, **kw: F.binary_cross_entropy(x, y, weight=torch.rand(5), **kw),
                   lambda: (_x(), _x())),
    "bce_logits": (F.binary_cross_entropy_with_logits, lambda: (_x(), _x())),
    "soft_margin": (F.soft_margin_loss, lambda: (_x(), _x().sign())),
    "multilabel_soft_margin": (F.multilabel_soft_margin_loss, lambda: (_x(), _x().round())),
    "cross_entropy": (F.cross_entropy, lambda: (_x(), torch.randint(5, (6,)))),
    "cross_entropy_probs": (lambda x, y, **kw: F.cross_entropy(x, y.softmax(-1), **kw,
                                                               label_smoothing=0.1),
                            lambda: (_x(), _x())),
    "nll": (F.nll_loss, lambda: (_x().log_softmax(-1), torch.randint(5, (6,)))),
    "kl_div": (F.kl_div, lambda: (_x().log_softmax(-1), _x().softmax(-1))),
    "kl_div_log_target": (lambda x, y, **kw: F.kl_div(x, y, **kw, log_target=True),
                          lambda: (_x().log_softmax(-1), _x().log_softmax(-1))),
    "poisson_nll": (F.poisson_nll_loss, lambda: (_x(), _x())),
    "gaussian_nll": (lambda x, y, **kw: F.gaussian_nll_loss(x, y, torch.rand(6, 5) + 0.1, **kw),
                     lambda: (_x(), _x())),
    "hinge_embedding": (F.hinge_embedding_loss, lambda: (_x(), _x().sign())),
    "cosine_embedding": (lambda x, y, **kw: F.cosine_embedding_loss(x, y, torch.ones(6), **kw),
                         lambda: (_x(), _x())),
    "margin_ranking": (lambda x, y, **kw: F.margin_ranking_loss(x, y, torch.ones(6, 5), **kw),
                       lambda: (_x(), _x())),
    "triplet_margin": (lambda x, y, **kw: F.triplet_margin_loss(x, y, torch.rand(6, 5), **kw),
                       lambda: (_x(), _x())),
    "multi_margin": (F.multi_margin_loss, lambda: (_x(), torch.randint(5, (6,)))),
    "multilabel_margin": (F.multilabel_margin_loss, lambda: (_x(), torch.randint(5, (6, 5)))),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_loss_keeps_the_storage_the_real_kernel_keeps(loss, reduction):
    """Rule 5: mse, smooth_l1, bce and soft_margin, reduced, return a 0-d tensor on the whole
    unreduced buffer (the real kernel's storage, the oracle); every other loss a fresh one.
    Forward and backward, every aten call: fake storage bytes == real storage bytes."""
    fn, inputs = LOSSES[loss]
    assert _storage_gaps(lambda x, y: fn(x, y, reduction=reduction), *inputs()) == []


REDUCTIONS = {
    "sum": lambda x: x.sum(), "mean": lambda x: x.mean(), "mean_dim": lambda x: x.mean(1),
    "amax": lambda x: x.amax(1), "max": lambda x: x.max(), "max_dim": lambda x: x.max(1).values,
    "min": lambda x: x.min(), "var": lambda x: x.var(), "std_dim": lambda x: x.std(0),
    "var_mean": lambda x: sum(torch.var_mean(x, 1)), "norm": lambda x: x.norm(),
    "norm_dim": lambda x: torch.linalg.vector_norm(x, dim=1), "logsumexp": lambda x: x.logsumexp(1),
    "prod": lambda x: x.prod(), "cumsum": lambda x: x.cumsum(0), "softmax": lambda x: x.softmax(1),
    "log_softmax": lambda x: x.log_softmax(0), "nansum": lambda x: x.nansum(),
    "trace": lambda x: x[:5].trace(), "dist": lambda x: torch.dist(x, x.flip(0)),
}


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_every_reduction_keeps_the_storage_the_real_kernel_keeps(reduction):
    assert _storage_gaps(REDUCTIONS[reduction], _x()) == []


def test_reduced_mse_holds_the_unreduced_buffer_by_hand():
    """The hand oracle behind Rule 5: 100 x 50 fp32 elements, 4 bytes each, alive in the loss."""
    a, b = torch.randn(100, 50), torch.randn(100, 50)
    fake_mode = FakeTensorMode()
    with fake_mode, FidelityMode():
        fake = F.mse_loss(fake_mode.from_tensor(a), fake_mode.from_tensor(b))
    assert F.mse_loss(a, b).untyped_storage().nbytes() == 100 * 50 * 4
    assert fake.shape == () and fake.untyped_storage().nbytes() == 100 * 50 * 4
