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
