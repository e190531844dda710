"""Each fidelity rule: the real CPU kernel beside the fake one, outputs' dtypes and sizes."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

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
