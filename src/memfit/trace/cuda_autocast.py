"""CUDA's autocast policy applied to CPU tensors, so a CPU trace casts like a GPU step.

``torch.autocast("cuda")`` casts only CUDA tensors, and CPU autocast follows other lists (CPU
runs softmax and layer_norm in the input's dtype; CUDA runs them in fp32). A trace on fake CPU
tensors therefore applies CUDA's policy itself, with ``CudaAutocastMode``.

Note 1 (why a torch-function mode). Real autocast casts at the Autocast dispatch key, which sits
above Autograd, so autograd records each cast and the backward saves the cast (fp16) inputs. A
``TorchFunctionMode`` runs above autograd too; its casts are recorded the same way. A dispatch
mode would run below autograd and could not change what autograd saves.

Note 2 (entry points). A mode sees Python-level calls, not aten ops. The policy lists name aten
ops; each maps to the C++ bindings of that name (``torch.X``, ``Tensor.X``, ``torch._C._nn.X``,
``torch._C._linalg.X``, ``torch._C._special.X``). Python wrappers (``F.softmax``, ``F.layer_norm``,
``Tensor.__rpow__``, ``torch.norm`` ...) are not in the table: the mode runs their body with
itself still active (``redispatch_function``), so the binding they reach is cast instead. Inside
a listed op the mode is off, as autocast excludes its own key inside a wrapped op: nothing is
cast twice. Calls with ``out=`` are not autocast, and in-place variants are not in the lists.
A Python method that calls its C++ twin (``Tensor.unflatten`` -> ``super().unflatten``) is
reported a second time under its own name; that report is passed through, not looked into.

Note 3 (composite bindings). Some bindings not in the lists run C++ code that calls a listed
op (``torch.square`` calls ``pow``; ``cross_entropy_loss`` calls ``log_softmax`` and
``nll_loss``). Real autocast casts at that inner call, which Python cannot see, so these entry
points get the inner op's policy (``_COMPOSITES``). Their outputs match real autocast; a cast made
at the entry rather than inside may hold a transient copy real CUDA does not. The tests find
each by running it under the real AutocastCUDA kernels on fake CUDA tensors.

Note 4 (the weight cache). ``cached_cast`` in autocast_mode.cpp keeps the lower-precision copy of
every fp32 leaf that requires grad and is not a view (in practice: parameters) until the
outermost autocast region exits. A parameter used by several ops in one forward is cast once,
and its copy lives to the end of the region even if no output holds it. The cache here is keyed
by the tensor's id, guarded by a weakref so a reused id never hits, and cleared on the outermost
``__exit__``.

Note 5 (autocast state). On entry the mode sets the thread's CUDA autocast state (enabled,
dtype, cache) as ``torch.autocast("cuda")`` would, so model code asking
``torch.is_autocast_enabled("cuda")`` or ``torch.get_autocast_dtype("cuda")`` sees a GPU run, and
each call reads that state: inside ``torch.autocast("cuda", enabled=False)`` nothing is cast. On a
CPU-only build, ``torch.autocast("cuda")`` *enabling* warns and disables instead, so a nested
enabling region runs uncast here. Code that picks ``x.device.type`` sees "cpu", whose autocast
stays off: ``maybe_autocast("cpu", enabled=False)`` is then a no-op and that region is cast.

Note 6 (checkpoint recompute). ``torch.utils.checkpoint`` re-enters autocast for the recompute
only through ``torch.autocast``, which cannot enable CUDA autocast on a CPU build, so the
recompute (run in backward, outside this mode) is uncast: non-reentrant checkpoint then raises a
metadata mismatch, reentrant checkpoint silently recomputes in fp32. Pass
``context_fn=lambda: (contextlib.nullcontext(), CudaAutocastMode(dtype))`` to re-enter it; a
fresh mode per recompute is what real autocast does (new region, new weight cache).
"""

from __future__ import annotations

import enum
import weakref
from types import FunctionType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = [
    "BANNED_OPS", "CudaAutocastMode", "FP32_OPS", "FP32_SET_DTYPE_OPS", "LOWER_PRECISION_OPS",
    "PROMOTE_OPS", "UNREACHABLE_OPS", "policy_of",
]

# The CUDA policy of torch 2.13: the aten ops registered for DispatchKey::AutocastCUDA by
# aten/src/ATen/autocast_mode.cpp from the lists in autocast_mode.h (AT_FORALL_*), overload names
# dropped. They back the docs' "Autocast Op Reference"
# (https://docs.pytorch.org/docs/stable/amp.html#autocast-op-reference), which names fewer ops
# (no scaled_dot_product_attention, einsum, rms_norm, upsample_* ...). The tests check these
# lists against the installed dispatcher and the doc lists against these.

# Docs: "CUDA Ops that can autocast to float16" (AT_FORALL_LOWER_PRECISION_FP, policy
# lower_precision_fp): every eligible input is cast to the autocast dtype.
LOWER_PRECISION_OPS = (
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm",
    "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
)
# Docs: "CUDA Ops that can autocast to float32" (AT_FORALL_FP32, policy fp32): every eligible
# input is cast to fp32.
FP32_OPS = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss",
    "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
# Also "...autocast to float32" (AT_FORALL_FP32_SET_OPT_DTYPE and norm's fp32_append_dtype):
# inputs are not cast; if the first input is eligible and no dtype was given, dtype=float32 is
# passed, so the kernel reads the input as is and writes fp32. An explicit dtype is respected.
FP32_SET_DTYPE_OPS = (
    "prod", "softmax", "log_softmax", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "sum", "norm",
)
# Docs: "CUDA Ops that promote to the widest input type" (AT_FORALL_PROMOTE): all eligible
# inputs are cast to fp32 if any is fp32, else they all stay in the autocast dtype.
PROMOTE_OPS = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
)
# Docs: "Prefer binary_cross_entropy_with_logits over binary_cross_entropy": raises under autocast.
BANNED_OPS = ("binary_cross_entropy",)
# Listed aten ops no Python call reaches directly.
UNREACHABLE_OPS = {
    "_thnn_fused_lstm_cell": "called only by the CUDA kernels of lstm_cell (listed)",
    "_thnn_fused_gru_cell": "called only by the CUDA kernels of gru_cell (listed)",
}


class _Policy(enum.Enum):
    LOWER = "lower_precision_fp"
    FP32 = "fp32"
    FP32_SET_DTYPE = "fp32_set_opt_dtype"
    PROMOTE = "promote"
    BANNED = "banned"


# Aliases and composites (Note 3), each with the policy of the listed op it reaches.
_COMPOSITES = {
    _Policy.LOWER: (
        "__matmul__",                                       # Tensor @ Tensor -> matmul
        "lstm", "gru", "rnn_tanh", "rnn_relu",              # cuDNN RNNs: AutocastRNN.cpp casts
    ),                                                      # input, hx and weights to fp16
    _Policy.FP32: (
        "arccos", "arcsin", "special_erfinv", "special_expm1", "special_log1p",   # aliases
        "special_logsumexp", "square",                      # square -> pow
        "norm_except_dim", "pairwise_distance",             # -> norm
        "trapezoid", "trapz", "cumulative_trapezoid", "sum_to_size",  # -> sum, cumsum
        "cross_entropy_loss", "nll_loss_nd",                # -> log_softmax, nll_loss(2d)
    ),
    _Policy.FP32_SET_DTYPE: ("special_softmax", "special_log_softmax", "linalg_norm"),
}

_NAMESPACES = (torch._C._VariableFunctions, torch._C.TensorBase, torch._C._nn,
               torch._C._linalg, torch._C._special)


def _build_table() -> dict:
    groups = {
        _Policy.LOWER: LOWER_PRECISION_OPS + _COMPOSITES[_Policy.LOWER],
        _Policy.FP32: FP32_OPS + _COMPOSITES[_Policy.FP32],
        _Policy.FP32_SET_DTYPE: FP32_SET_DTYPE_OPS + _COMPOSITES[_Policy.FP32_SET_DTYPE],
        _Policy.PROMOTE: PROMOTE_OPS,
        _Policy.BANNED: BANNED_OPS,
    }
    table = {}
    for policy, names in groups.items():
        for name in names:
            for ns in _NAMESPACES:
                if hasattr(ns, name):
                    table[getattr(ns, name)] = policy
    return table


_TABLE = _build_table()
_redispatch = getattr(torch.overrides, "redispatch_function", None)   # Note 2
_NORMS = (torch._C._VariableFunctions.norm, torch._C.TensorBase.norm)
_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def policy_of(func) -> str | None:
    """The CUDA autocast policy the mode applies to ``func`` ("lower_precision_fp", "fp32",
    "fp32_set_opt_dtype", "promote", "banned"), or None for a call it passes through."""
    policy = _TABLE.get(func)
    return None if policy is None else policy.value


def _eligible(x) -> bool:
    """``is_eligible`` in autocast_mode.h: a floating tensor that is not fp64."""
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _promote_type(lower: torch.dtype, tensors) -> torch.dtype:
    """``promote_type``/``prioritize`` in autocast_mode.h: fp32 wins, fp64 is ignored."""
    current = lower
    for t in tensors:
        if not _eligible(t):
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif t.dtype != lower:
            raise RuntimeError(f"Unexpected floating ScalarType {t.dtype} in at::autocast::"
                               f"prioritize (autocast dtype {lower})")
    return current


class CudaAutocastMode(TorchFunctionMode):
    """``torch.autocast("cuda", dtype)`` for tensors of any device, CUDA's op lists included.

    Use it where a GPU step would use ``torch.autocast("cuda", dtype=dtype)``; backward runs
    outside it, as with real autocast. The mode is re-entrant (Note 2 enters it per call); the
    weight cache lives until the outermost exit (Note 4).
    """

    def __init__(self, dtype: torch.dtype = torch.float16, enabled: bool = True,
                 cache_enabled: bool = True):
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CudaAutocastMode dtype={dtype} must be torch.float16 or "
                             "torch.bfloat16, the dtypes CUDA autocast supports")
        if _redispatch is None:
            raise RuntimeError(f"CudaAutocastMode needs torch.overrides.redispatch_function, "
                               f"missing in torch {torch.__version__}: upgrade torch")
        self.dtype = dtype
        self.enabled = enabled
        self.cache_enabled = cache_enabled
        self._depth = 0
        self._saved_state: tuple | None = None
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._inside: list = []                           # Python wrappers being run (Note 2)

    def __enter__(self):
        if self._depth == 0:                              # Note 5
            self._saved_state = (torch.is_autocast_enabled("cuda"),
                                 torch.get_autocast_dtype("cuda"),
                                 torch.is_autocast_cache_enabled())
            torch.set_autocast_enabled("cuda", self.enabled)
            torch.set_autocast_dtype("cuda", self.dtype)
            torch.set_autocast_cache_enabled(self.cache_enabled)
            torch.autocast_increment_nesting()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        super().__exit__(exc_type, exc_val, exc_tb)
        self._depth -= 1
        if self._depth == 0:
            self._cache.clear()                           # Note 4
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            enabled, dtype, cache_enabled = self._saved_state
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", dtype)
            torch.set_autocast_cache_enabled(cache_enabled)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        policy = _TABLE.get(func)
        if (policy is None or kwargs.get("out") is not None
                or not torch.is_autocast_enabled("cuda")):
            if isinstance(func, FunctionType) and not (self._inside and self._inside[-1] is func):
                return self._look_inside(func, types, args, kwargs)
            return func(*args, **kwargs)
        if policy is _Policy.BANNED:
            raise RuntimeError(_BANNED_MESSAGE)
        if policy is _Policy.FP32_SET_DTYPE:
            args, kwargs = _set_fp32_dtype(func, args, kwargs)
        else:
            lower = torch.get_autocast_dtype("cuda")
            if policy is _Policy.PROMOTE:
                to = _promote_type(lower, tree_leaves((args, kwargs)))
            else:
                to = lower if policy is _Policy.LOWER else torch.float32
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: self._cached_cast(t, to, lower), (args, kwargs))
        return func(*args, **kwargs)                      # mode off inside: no second cast

    def _look_inside(self, func, types, args, kwargs):
        """Run a Python wrapper's body with the mode on (Note 2). A wrapper that calls its C++
        twin (``super().unflatten``) is reported again under its own name: that second report
        is passed through, or the wrapper would recurse forever."""
        self._inside.append(func)
        try:
            with self:
                return _redispatch(func, types, args, kwargs)
        finally:
            self._inside.pop()

    def _cached_cast(self, t: torch.Tensor, to: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        """``cached_cast`` in autocast_mode.cpp (Note 4)."""
        if not _eligible(t) or t.dtype == to:
            return t
        cacheable = (to == lower and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
                     and not t._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return t.to(to)
        hit = self._cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        cast = t.to(to)
        self._cache[id(t)] = (weakref.ref(t), cast)
        return cast


def _set_fp32_dtype(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``fp32_set_opt_dtype``/``fp32_append_dtype``: dtype=float32 unless given or ineligible."""
    first = args[0] if args else kwargs.get("input", kwargs.get("self"))
    explicit = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
    if explicit or not _eligible(first):
        return args, kwargs
    if func in _NORMS and len(args) == 1 and "p" not in kwargs:
        args = (args[0], 2)                               # norm(x) has no dtype overload; p=2
    return args, {**kwargs, "dtype": torch.float32}
