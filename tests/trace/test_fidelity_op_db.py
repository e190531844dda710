"""The audit behind fidelity Rule 5, over every op of torch's own ``op_db`` (slow; needs
``expecttest``, which ``torch.testing._internal`` imports).

Each OpInfo's first samples run for real on CPU in fp32, forward and backward; every aten call
whose outputs include a storage its inputs do not hold is replayed on fakes under
``FidelityMode``, and the storage bytes of each output must equal the real kernel's (the
oracle). This found the four losses Rule 5 names, and nothing else.
"""

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from memfit.trace.fidelity import FidelityMode

pytestmark = pytest.mark.slow


class _Audit(TorchDispatchMode):
    def __init__(self, name, gaps):
        super().__init__()
        self.name, self.gaps = name, gaps

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        held = {x.untyped_storage()._cdata for x in tree_flatten((args, kwargs))[0]
                if isinstance(x, torch.Tensor)}
        outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        if not any(x.untyped_storage()._cdata not in held for x in outs):
            return out
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fargs = tree_map(lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x,
                         (args, kwargs))
        try:
            with mode, FidelityMode():
                fout = func(*fargs[0], **fargs[1])
        except Exception:       # noqa: BLE001 - no fake kernel: a trace stops there, loudly
            return out
        fakes = [x for x in tree_flatten(fout)[0] if isinstance(x, torch.Tensor)]
        for real, fake in zip(outs, fakes):
            if (real.untyped_storage()._cdata not in held
                    and real.untyped_storage().nbytes() != fake.untyped_storage().nbytes()):
                self.gaps.append((self.name, str(func), real.untyped_storage().nbytes(),
                                  fake.untyped_storage().nbytes()))
        return out


def test_every_op_db_op_keeps_the_storage_the_real_kernel_keeps():
    pytest.importorskip("expecttest")
    from torch.testing._internal.common_methods_invocations import op_db

    gaps = []
    warnings.simplefilter("ignore")
    for op in op_db:
        try:
            samples = list(op.sample_inputs("cpu", torch.float32,
                                            requires_grad=op.supports_autograd))[:4]
        except Exception:       # noqa: BLE001 - an OpInfo without fp32 CPU samples
            continue
        for s in samples:
            try:
                with _Audit(op.name, gaps):
                    out = op(s.input, *s.args, **s.kwargs)
                    outs = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)
                            and x.requires_grad and x.is_floating_point()]
                    if outs:
                        sum(o.sum() for o in outs).backward()
            except Exception:   # noqa: BLE001 - a sample the real op refuses
                continue
    assert gaps == []
