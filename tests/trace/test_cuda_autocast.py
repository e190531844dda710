"""CudaAutocastMode against its two sources: the docs' op lists and PyTorch's own CUDA kernels.

Oracle. The AutocastCUDA kernels (aten/src/ATen/autocast_mode.cpp) are compiled into the CPU
build too; they are inactive only because no tensor is on CUDA. Fake tensors can claim
``device="cuda"``, so ``_real_cuda_autocast`` switches the CUDA autocast state on by hand and
runs the same call on fake CUDA tensors through the real kernels. For the calls in
``NO_FAKE_CUDA`` a fake CUDA kernel needs a CUDA build ("not linked with support for cuda
devices"); there only the expected value written in the case, from the doc section named, is
checked.
"""

import contextlib
import gc
import logging
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointError, checkpoint

from memfit.trace.cuda_autocast import (
    BANNED_OPS, FP32_OPS, FP32_SET_DTYPE_OPS, LOWER_PRECISION_OPS, PROMOTE_OPS, UNREACHABLE_OPS,
    CudaAutocastMode, policy_of,
)
from memfit.trace.fake import FakeCopier

F16, F32 = torch.float16, torch.float32

# Verbatim from the "Autocast Op Reference", docs/source/amp.md of pytorch/pytorch main
# (commit 4e0ff98084d4), rendered at
# https://docs.pytorch.org/docs/stable/amp.html#autocast-op-reference
DOC_CUDA_FP16 = """__matmul__, addbmm, addmm, addmv, addr, baddbmm, bmm, multi_dot, conv1d, conv2d,
conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d, GRUCell, linear, LSTMCell, matmul,
mm, mv, prelu, RNNCell"""
DOC_CUDA_FP32 = """__pow__, __rdiv__, __rpow__, __rtruediv__, acos, asin,
binary_cross_entropy_with_logits, cosh, cosine_embedding_loss, cdist, cosine_similarity,
cross_entropy, cumprod, cumsum, dist, erfinv, exp, expm1, group_norm, hinge_embedding_loss,
kl_div, l1_loss, layer_norm, log, log_softmax, log10, log1p, log2, margin_ranking_loss,
mse_loss, multilabel_margin_loss, multi_margin_loss, nll_loss, norm, normalize, pdist,
poisson_nll_loss, pow, prod, reciprocal, rsqrt, sinh, smooth_l1_loss, soft_margin_loss,
softmax, softmin, softplus, sum, renorm, tan, triplet_margin_loss"""
DOC_CUDA_PROMOTE = """addcdiv, addcmul, atan2, bilinear, cross, dot, grid_sample, index_put,
scatter_add, tensordot"""


def _names(doc):
    return [n.strip() for n in doc.replace("\n", " ").split(",")]


# One call per doc entry. ``a`` makes the op's input in the dtype under test (fp32 for the fp16
# list, fp16 for the fp32 list), ``b`` an fp32 tensor (the promote list's wider input), ``i`` an
# int64 tensor. Each returns the op's (first) output.
FP16_CALLS = {
    "__matmul__": lambda a, b, i: a(2, 3) @ a(3, 4),
    "addbmm": lambda a, b, i: torch.addbmm(a(3, 4), a(2, 3, 5), a(2, 5, 4)),
    "addmm": lambda a, b, i: torch.addmm(a(3, 4), a(3, 5), a(5, 4)),
    "addmv": lambda a, b, i: torch.addmv(a(3), a(3, 4), a(4)),
    "addr": lambda a, b, i: torch.addr(a(3, 4), a(3), a(4)),
    "baddbmm": lambda a, b, i: torch.baddbmm(a(2, 3, 4), a(2, 3, 5), a(2, 5, 4)),
    "bmm": lambda a, b, i: torch.bmm(a(2, 3, 5), a(2, 5, 4)),
    "multi_dot": lambda a, b, i: torch.linalg.multi_dot([a(3, 4), a(4, 5), a(5, 2)]),
    "conv1d": lambda a, b, i: F.conv1d(a(1, 2, 8), a(3, 2, 3)),
    "conv2d": lambda a, b, i: F.conv2d(a(1, 2, 8, 8), a(3, 2, 3, 3)),
    "conv3d": lambda a, b, i: F.conv3d(a(1, 2, 4, 4, 4), a(3, 2, 3, 3, 3)),
    "conv_transpose1d": lambda a, b, i: F.conv_transpose1d(a(1, 2, 8), a(2, 3, 3)),
    "conv_transpose2d": lambda a, b, i: F.conv_transpose2d(a(1, 2, 8, 8), a(2, 3, 3, 3)),
    "conv_transpose3d": lambda a, b, i: F.conv_transpose3d(a(1, 2, 4, 4, 4), a(2, 3, 3, 3, 3)),
    "GRUCell": lambda a, b, i: torch.gru_cell(a(2, 4), a(2, 3), a(9, 4), a(9, 3), a(9), a(9)),
    "linear": lambda a, b, i: F.linear(a(2, 3), a(4, 3)),
    "LSTMCell": lambda a, b, i: torch.lstm_cell(a(2, 4), [a(2, 3), a(2, 3)], a(12, 4), a(12, 3),
                                                a(12), a(12))[0],
    "matmul": lambda a, b, i: torch.matmul(a(2, 3), a(3, 4)),
    "mm": lambda a, b, i: torch.mm(a(2, 3), a(3, 4)),
    "mv": lambda a, b, i: torch.mv(a(3, 4), a(4)),
    "prelu": lambda a, b, i: F.prelu(a(2, 3), a(1)),
    "RNNCell": lambda a, b, i: torch.rnn_tanh_cell(a(2, 4), a(2, 3), a(3, 4), a(3, 3), a(3), a(3)),
}
FP32_CALLS = {
    "__pow__": lambda a, b, i: a(3) ** 2,
    "__rdiv__": lambda a, b, i: a(3).__rdiv__(2),
    "__rpow__": lambda a, b, i: 2 ** a(3),
    "__rtruediv__": lambda a, b, i: 2 / a(3),
    "binary_cross_entropy_with_logits":
        lambda a, b, i: F.binary_cross_entropy_with_logits(a(3), a(3)),
    "cosine_embedding_loss": lambda a, b, i: F.cosine_embedding_loss(a(2, 3), a(2, 3), a(2)),
    "cdist": lambda a, b, i: torch.cdist(a(2, 3), a(4, 3)),
    "cosine_similarity": lambda a, b, i: F.cosine_similarity(a(2, 3), a(2, 3)),
    "cross_entropy": lambda a, b, i: F.cross_entropy(a(2, 3), i(2)),
    "cumprod": lambda a, b, i: torch.cumprod(a(3), 0),
    "cumsum": lambda a, b, i: torch.cumsum(a(3), 0),
    "dist": lambda a, b, i: torch.dist(a(3), a(3)),
    "group_norm": lambda a, b, i: F.group_norm(a(2, 4, 3), 2),
    "hinge_embedding_loss": lambda a, b, i: F.hinge_embedding_loss(a(3), a(3)),
    "kl_div": lambda a, b, i: F.kl_div(a(3), a(3), reduction="sum"),
    "l1_loss": lambda a, b, i: F.l1_loss(a(3), a(3)),
    "layer_norm": lambda a, b, i: F.layer_norm(a(2, 3), [3]),
    "log_softmax": lambda a, b, i: F.log_softmax(a(2, 3), -1),
    "margin_ranking_loss": lambda a, b, i: F.margin_ranking_loss(a(3), a(3), a(3)),
    "mse_loss": lambda a, b, i: F.mse_loss(a(3), a(3)),
    "multilabel_margin_loss": lambda a, b, i: F.multilabel_margin_loss(a(2, 3), i(2, 3)),
    "multi_margin_loss": lambda a, b, i: F.multi_margin_loss(a(2, 3), i(2)),
    "nll_loss": lambda a, b, i: F.nll_loss(a(2, 3), i(2)),
    "norm": lambda a, b, i: torch.norm(a(3)),
    "normalize": lambda a, b, i: F.normalize(a(2, 3)),
    "pdist": lambda a, b, i: F.pdist(a(3, 2)),
    "poisson_nll_loss": lambda a, b, i: F.poisson_nll_loss(a(3), a(3)),
    "pow": lambda a, b, i: torch.pow(a(3), 2),
    "prod": lambda a, b, i: torch.prod(a(3)),
    "renorm": lambda a, b, i: torch.renorm(a(2, 3), 2, 0, 1.0),
    "smooth_l1_loss": lambda a, b, i: F.smooth_l1_loss(a(3), a(3)),
    "soft_margin_loss": lambda a, b, i: F.soft_margin_loss(a(3), a(3)),
    "softmax": lambda a, b, i: F.softmax(a(2, 3), -1),
    "softmin": lambda a, b, i: F.softmin(a(2, 3), -1),
    "softplus": lambda a, b, i: F.softplus(a(3)),
    "sum": lambda a, b, i: torch.sum(a(3)),
    "triplet_margin_loss": lambda a, b, i: F.triplet_margin_loss(a(2, 3), a(2, 3), a(2, 3)),
}
for _unary in ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log1p", "log2",
               "reciprocal", "rsqrt", "sinh", "tan"):
    FP32_CALLS[_unary] = lambda a, b, i, _op=getattr(torch, _unary): _op(a(3))
PROMOTE_CALLS = {
    "addcdiv": lambda a, b, i: torch.addcdiv(a(3), a(3), b(3)),
    "addcmul": lambda a, b, i: torch.addcmul(a(3), a(3), b(3)),
    "atan2": lambda a, b, i: torch.atan2(a(3), b(3)),
    "bilinear": lambda a, b, i: F.bilinear(a(2, 3), a(2, 4), b(5, 3, 4)),
    "cross": lambda a, b, i: torch.cross(a(2, 3), b(2, 3), dim=1),
    "dot": lambda a, b, i: torch.dot(a(3), b(3)),
    "grid_sample": lambda a, b, i: F.grid_sample(a(1, 2, 4, 4), b(1, 3, 3, 2), align_corners=False),
    "index_put": lambda a, b, i: torch.index_put(a(3), (i(2),), b(2)),
    "scatter_add": lambda a, b, i: torch.scatter_add(a(3), 0, i(2), b(2)),
    "tensordot": lambda a, b, i: torch.tensordot(a(2, 3), b(3, 4), dims=1),
}
# (call, input dtype, expected output dtype, policies the call must reach)
SECTIONS = {
    "fp16": (FP16_CALLS, F32, F16, {"lower_precision_fp"}),
    "fp32": (FP32_CALLS, F16, F32, {"fp32", "fp32_set_opt_dtype"}),
    "promote": (PROMOTE_CALLS, F16, F32, {"promote"}),
}
# Not in the docs but in the 2.13 kernels, or reached through a composite (Note 3 of the
# module); expected values from autocast_mode.h's lists, checked against the real kernels too.
EXTRA_CALLS = {
    "scaled_dot_product_attention": (lambda a, b, i: F.scaled_dot_product_attention(
        a(1, 2, 4, 8), a(1, 2, 4, 8), a(1, 2, 4, 8)), F32, F16),
    "einsum": (lambda a, b, i: torch.einsum("ij,jk->ik", a(2, 3), a(3, 4)), F32, F16),
    "linalg.vecdot": (lambda a, b, i: torch.linalg.vecdot(a(2, 3), a(2, 3)), F32, F16),
    "lstm": (lambda a, b, i: torch.nn.LSTM(4, 3, device=a(1).device)(a(5, 2, 4))[0], F32, F16),
    "rms_norm": (lambda a, b, i: F.rms_norm(a(2, 3), [3]), F16, F32),
    "logsumexp": (lambda a, b, i: torch.logsumexp(a(2, 3), -1), F16, F32),
    "interpolate": (lambda a, b, i: F.interpolate(a(1, 2, 4, 4), scale_factor=2), F16, F32),
    "square": (lambda a, b, i: torch.square(a(3)), F16, F32),
    "arccos": (lambda a, b, i: torch.arccos(a(3)), F16, F32),
    "pairwise_distance": (lambda a, b, i: F.pairwise_distance(a(2, 3), a(2, 3)), F16, F32),
    "trapezoid": (lambda a, b, i: torch.trapezoid(a(3)), F16, F32),
    "sum_to_size": (lambda a, b, i: a(2, 3).sum_to_size(3), F16, F32),
    "linalg.norm": (lambda a, b, i: torch.linalg.norm(a(2, 3)), F16, F32),
    "special.softmax": (lambda a, b, i: torch.special.softmax(a(2, 3), -1), F16, F32),
    "special.logsumexp": (lambda a, b, i: torch.special.logsumexp(a(2, 3), -1), F16, F32),
    "norm_except_dim": (lambda a, b, i: torch.norm_except_dim(a(2, 3), 2, 0), F16, F32),
    "softmax, explicit dtype": (lambda a, b, i: torch.softmax(a(2, 3), -1, dtype=F16), F16, F16),
    "sum, explicit dtype": (lambda a, b, i: a(3).sum(dtype=F16), F16, F16),
    "relu (no list)": (lambda a, b, i: F.relu(a(3)), F16, F16),
    "gelu (no list)": (lambda a, b, i: F.gelu(a(3)), F16, F16),
    "mean (no list)": (lambda a, b, i: a(3).mean(), F16, F16),
}


# Calls whose fake CUDA kernels need a CUDA build: no real-kernel answer on this machine.
NO_FAKE_CUDA = {"GRUCell", "grid_sample", "lstm"}


def _factories(device, dtype):
    return (lambda *s: torch.empty(s, dtype=dtype, device=device),
            lambda *s: torch.empty(s, dtype=F32, device=device),
            lambda *s: torch.zeros(s, dtype=torch.int64, device=device))


@contextlib.contextmanager
def _real_cuda_autocast(dtype=F16):
    """PyTorch's own AutocastCUDA kernels, switched on as torch.autocast("cuda") would."""
    state = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", state[0])
        torch.set_autocast_dtype("cuda", state[1])


def _ours(call, in_dtype):
    with FakeTensorMode(), CudaAutocastMode():
        return call(*_factories("cpu", in_dtype)).dtype


def _real(call, in_dtype):
    """The real kernels' answer on fake CUDA tensors, or None where a fake CUDA kernel can't run."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")   # logs each failed meta call
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), FakeTensorMode(), _real_cuda_autocast():
            warnings.simplefilter("ignore")
            return call(*_factories("cuda", in_dtype)).dtype
    except (RuntimeError, AssertionError) as e:
        if any(m in str(e) for m in ("not linked with support for cuda", "not compiled with CUDA")):
            return None
        raise
    finally:
        fake_log.setLevel(level)


class _Spy(CudaAutocastMode):
    """Records the policy of every call the mode intercepts."""

    def __init__(self):
        super().__init__()
        self.policies = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if policy_of(func) is not None:
            self.policies.append(policy_of(func))
        return super().__torch_function__(func, types, args, kwargs)


class _Record(TorchDispatchMode):
    """Records aten calls (below autograd) and the tensors ``_to_copy`` made."""

    def __init__(self):
        super().__init__()
        self.calls, self.casts = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, [a.dtype for a in args if isinstance(a, torch.Tensor)]))
        if func is torch.ops.aten._to_copy.default:
            self.casts.append(weakref.ref(out))
        return out


def test_lists_are_the_installed_cuda_kernels():
    """Every aten op with an AutocastCUDA kernel in this torch is in exactly one list."""
    registered = {r.split("::")[1].split(".")[0]
                  for r in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")}
    lists = [LOWER_PRECISION_OPS, FP32_OPS, FP32_SET_DTYPE_OPS, PROMOTE_OPS, BANNED_OPS]
    listed = [name for names in lists for name in names]
    assert len(listed) == len(set(listed))
    assert set(listed) == registered


def test_every_listed_op_has_an_entry_point_or_a_reason():
    namespaces = (torch._C._VariableFunctions, torch._C.TensorBase, torch._C._nn,
                  torch._C._linalg, torch._C._special)
    for name in LOWER_PRECISION_OPS + FP32_OPS + FP32_SET_DTYPE_OPS + PROMOTE_OPS + BANNED_OPS:
        entries = [getattr(ns, name) for ns in namespaces if hasattr(ns, name)]
        assert entries or name in UNREACHABLE_OPS, name
        assert all(policy_of(f) is not None for f in entries), name


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_doc_calls_cover_the_doc_lists(section):
    doc = {"fp16": DOC_CUDA_FP16, "fp32": DOC_CUDA_FP32, "promote": DOC_CUDA_PROMOTE}[section]
    assert sorted(SECTIONS[section][0]) == sorted(_names(doc))


@pytest.mark.parametrize("section,name",
                         [(s, n) for s in sorted(SECTIONS) for n in sorted(SECTIONS[s][0])])
def test_doc_ops_cast_like_the_docs_and_the_real_kernels(section, name):
    calls, in_dtype, expected, policies = SECTIONS[section]
    spy = _Spy()
    with FakeTensorMode(), spy:
        out = calls[name](*_factories("cpu", in_dtype))
    assert out.dtype == expected                     # the doc section's dtype
    assert policies & set(spy.policies), spy.policies  # reached through an intercepted entry
    assert _real(calls[name], in_dtype) == (None if name in NO_FAKE_CUDA else expected)


@pytest.mark.parametrize("name", sorted(EXTRA_CALLS))
def test_ops_beyond_the_docs_match_the_real_kernels(name):
    call, in_dtype, expected = EXTRA_CALLS[name]
    assert _ours(call, in_dtype) == expected
    assert _real(call, in_dtype) == (None if name in NO_FAKE_CUDA else expected)


def test_basic_casting_rules_on_real_tensors():
    x32, w32 = torch.randn(2, 3), torch.randn(4, 3)
    x16 = x32.half()
    with CudaAutocastMode():
        assert F.linear(x32, w32).dtype == F16
        assert torch.softmax(x16, -1).dtype == F32
        assert F.layer_norm(x16, [3], torch.ones(3), torch.zeros(3)).dtype == F32
        assert torch.cat([x16, x32]).dtype == F32
        ints = torch.ones(2, 2, dtype=torch.int64)
        assert torch.mm(ints, ints).dtype == torch.int64
        assert torch.mm(x32.double(), w32.double().T).dtype == torch.float64
        assert torch.relu(x16).dtype == F16 and (x16 + x16).dtype == F16
        assert (x16 + x32).dtype == F32              # ordinary type promotion, no autocast
        assert torch.exp(x16, out=torch.empty(2, 3, dtype=F16)).dtype == F16  # out=: not eligible


def test_bfloat16_and_mixed_lower_precisions():
    with CudaAutocastMode(torch.bfloat16):
        assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.bfloat16
        # prioritize() in autocast_mode.h rejects a second lower-precision dtype
        with pytest.raises(RuntimeError, match="prioritize"):
            torch.dot(torch.randn(3, dtype=torch.bfloat16), torch.randn(3, dtype=F16))
    with pytest.raises(ValueError, match="dtype"):
        CudaAutocastMode(torch.float32)


def test_binary_cross_entropy_is_banned():
    x = torch.rand(3)
    with CudaAutocastMode(), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(x, x)


def test_nothing_is_cast_twice_inside_a_listed_op():
    x, w, b = torch.randn(2, 3, dtype=F16), torch.ones(3), torch.zeros(3)
    with CudaAutocastMode(), _Record() as rec:
        F.layer_norm(x, [3], w, b)          # F.layer_norm -> torch.layer_norm -> native_layer_norm
    assert len(rec.casts) == 1              # x -> fp32, once


def _weight_casts(**mode_kwargs):
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.empty(4, 3))
        x = torch.empty(2, 3, dtype=F16)
        with CudaAutocastMode(**mode_kwargs), _Record() as rec:
            F.linear(x, w)
            F.linear(x, w)
            F.linear(x, w * 1)
    return len(rec.casts)


def test_weight_cast_cache():
    # Expected from cached_cast in aten/src/ATen/autocast_mode.cpp: an fp32 leaf that requires
    # grad is cast once per region (w: 1 cast for 2 uses); a non-leaf is cast at each use
    # (w * 1: 1); with the cache off, every use casts (3). (The real kernels can't be the oracle
    # here: a fake CUDA tensor that requires grad aborts the process in this CPU build.)
    assert _weight_casts() == 2
    assert _weight_casts(cache_enabled=False) == 3


def test_cached_weight_copy_lives_until_the_region_exits():
    w = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 3, dtype=F16)
    with CudaAutocastMode():
        with _Record() as rec:
            y1, y2 = F.linear(x, w), F.linear(x, w)
        (cast,) = rec.casts
        del y1, y2, rec
        gc.collect()
        assert cast() is not None           # no output holds it; the cache does
    gc.collect()
    assert cast() is None


def test_gradients_equal_explicit_casts():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 3)
    with CudaAutocastMode():
        y = F.linear(x, w)
        loss = torch.softmax(y, -1).sum()
    loss.backward()
    w_ref = torch.nn.Parameter(w.detach().clone())
    ref = torch.softmax(F.linear(x.half(), w_ref.half()), -1, dtype=F32).sum()
    ref.backward()
    assert w.grad.dtype == F32
    assert torch.equal(w.grad, w_ref.grad)


def test_autocast_state_and_nested_disable():
    w = torch.randn(4, 3)
    x = torch.randn(2, 3)
    assert not torch.is_autocast_enabled("cuda")
    with CudaAutocastMode(torch.bfloat16):
        assert torch.is_autocast_enabled("cuda") and torch.is_autocast_enabled()
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16
        with torch.autocast("cuda", enabled=False):
            assert F.linear(x, w).dtype == F32
        assert F.linear(x, w).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cuda")
    with CudaAutocastMode(enabled=False):
        assert F.linear(x, w).dtype == F32


def test_checkpoint_recompute_needs_the_mode_again():
    """Note 6 of the module: the recompute runs in backward, outside the mode."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    x = torch.randn(2, 3, requires_grad=True)

    def block(a):
        return torch.softmax(F.linear(a, w), -1)

    with CudaAutocastMode():
        y = checkpoint(block, x, use_reentrant=False)
    with pytest.raises(CheckpointError, match="different metadata"):
        y.sum().backward()
    w.grad = None
    with CudaAutocastMode():
        y = checkpoint(block, x, use_reentrant=False,
                       context_fn=lambda: (contextlib.nullcontext(), CudaAutocastMode()))
    y.sum().backward()
    grad_checkpointed, w.grad = w.grad, None
    with CudaAutocastMode():
        y = block(x)
    y.sum().backward()
    assert torch.equal(grad_checkpointed, w.grad)     # same numerics as without checkpoint


def test_python_wrappers_are_looked_into():
    mha = torch.nn.MultiheadAttention(8, 2)           # F.multi_head_attention_forward (Python)
    x = torch.randn(5, 1, 8)
    with CudaAutocastMode():
        assert mha(x, x, x)[0].dtype == F16           # its linear / sdpa calls were cast
        # Tensor.unflatten calls super().unflatten, reported again as Tensor.unflatten
        assert x.unflatten(2, (2, 4)).shape == (5, 1, 2, 4)


class _SeenBelow(torch.overrides.TorchFunctionMode):
    """Entered before CudaAutocastMode, so it sees calls with the arguments the mode passed on."""

    def __init__(self, funcs):
        super().__init__()
        self.funcs, self.dtypes = funcs, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.funcs:
            self.dtypes += [a.dtype for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("tensors", ["real", "fake"])
def test_tiny_bert_forward_backward(tensors):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, attn_implementation="sdpa"))
    batch = {"input_ids": torch.randint(0, 100, (2, 8)), "labels": torch.tensor([0, 1])}
    fake_mode = contextlib.nullcontext()
    if tensors == "fake":                             # as the trace runs it
        copier = FakeCopier()
        model, batch, fake_mode = copier.module(model), copier.tree(batch), copier.mode
    sdpa = _SeenBelow({F.scaled_dot_product_attention})
    with fake_mode, _Record() as rec:
        with sdpa, CudaAutocastMode():
            loss = model(**batch).loss
        loss.backward()
    assert loss.dtype == F32                          # cross_entropy is on the fp32 list
    # q, k, v reach sdpa in fp16. (CPU's math sdpa then upcasts them to fp32 for its bmms: a
    # CPU kernel's choice, not autocast's, so bmm is not checked below.)
    assert sdpa.dtypes and all(d == F16 for d in sdpa.dtypes)
    linears = [dtypes for f, dtypes in rec.calls
               if f in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)]
    # 8 nn.Linear (query, key, value, attention output, intermediate, output, pooler,
    # classifier): 8 addmm forward, 2 mm each backward (input and weight grads). All fp16.
    assert len(linears) == 8 + 16
    assert all(d == F16 for dtypes in linears for d in dtypes)
    assert all(p.grad.dtype == F32 for p in model.parameters() if p.grad is not None)
