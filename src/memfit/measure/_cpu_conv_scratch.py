"""Rule 3 of ``measure._cpu_scratch``: a CPU convolution's own buffers, measured on its kernel.

The rule's figure for ``aten.convolution`` or ``aten.convolution_backward`` at given metadata is
what the real kernel held beside its outputs when it ran once at that metadata: fresh CPU
tensors of the operands' sizes, strides, storage offsets and dtypes (zeros: the bytes do not
depend on the values), the op called with every mode off (a trace's ``FakeTensorMode`` and
counters included) and without autograd, under ``torch.profiler`` with ``profile_memory``; the
peak of the allocator's events less the bytes of the storages it returned. It is kept per
(op, metadata, thread count, oneDNN switches), so each distinct convolution of a step runs
once per process. The first call of a shape holds what later calls hold (no first-call
buffers: measured on fresh processes).

What is not measured (0): an operand that is not a plain strided CPU tensor (a wrapper subclass,
an MKL-DNN tensor), a kernel that raises, and a call made while a ``torch.profiler`` with
memory profiling is already on (a second one cannot start inside it, and stopping it would end
the first): then a figure kept from an earlier call is still used. Kineto's start and stop
lines on stderr are held back while the rule measures.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memfit.measure._sizes import hint

__all__ = ["CONV_OPS", "conv_scratch", "measured_conv_scratch"]

_aten = torch.ops.aten
CONV_OPS = (_aten.convolution.default, _aten.convolution_backward.default)

_kept: dict[tuple, int] = {}       # (op, metadata, threads, switches) -> bytes


class _Meta(NamedTuple):
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


class _NotMeasured(Exception):
    pass


def _meta(x):
    """``x`` as hashable metadata (a tensor's sizes, strides, offset and dtype; SymInts by their
    hint), or ``_NotMeasured`` for an operand the rule does not rebuild."""
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter, FakeTensor) or \
                x.layout is not torch.strided or x.device.type != "cpu":
            raise _NotMeasured
        return _Meta(tuple(hint(n) for n in x.shape), tuple(hint(n) for n in x.stride()),
                     hint(x.storage_offset()), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_meta(v) for v in x)
    if isinstance(x, torch.SymInt):
        return hint(x)
    if isinstance(x, (torch.SymBool, torch.SymFloat)):
        raise _NotMeasured
    return x


def _real(m):
    """A CPU tensor of metadata ``m`` (zeros), or ``m`` rebuilt (lists as lists)."""
    if isinstance(m, _Meta):
        extent = 0 if 0 in m.size else 1 + sum((n - 1) * s for n, s in zip(m.size, m.stride))
        return torch.zeros(m.offset + extent, dtype=m.dtype).as_strided(m.size, m.stride,
                                                                         m.offset)
    if isinstance(m, tuple):
        return [_real(v) for v in m]
    return m


def _switches() -> tuple:
    """What else picks the kernel: the thread count (oneDNN's per-thread scratchpads), whether
    oneDNN is on, and the fp32 precision it may compute in."""
    conv = getattr(torch.backends.mkldnn, "conv", None)
    return (torch.get_num_threads(), torch.backends.mkldnn.enabled,
            torch.get_float32_matmul_precision(), getattr(conv, "fp32_precision", None))


def _profiling() -> bool:
    return torch.autograd._profiler_enabled()


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto writes a line to stderr at each profiler start and stop; hold them back."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _allocator_peak(prof) -> int:
    memory = sorted((e.start_ns(), i, e.nbytes()) for i, e in
                    enumerate(prof.profiler.kineto_results.events()) if e.name() == "[memory]")
    live = peak = 0
    for _, _, delta in memory:
        live += delta
        peak = max(peak, live)
    return peak


def _returned_bytes(out) -> int:
    seen: dict[int, int] = {}
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measured_conv_scratch(func, args_meta, kwargs_meta) -> int:
    """Run ``func`` once on fresh CPU tensors of the metadata (``_meta``) and return what its
    kernel held beside its outputs, by the allocator's events."""
    from torch.profiler import ProfilerActivity, profile

    collecting = gc.isenabled()
    gc.disable()           # a collection inside the window would free tensors of the caller's
    try:
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad(), \
                torch.autocast("cpu", enabled=False):
            args, kwargs = _real(args_meta), {k: _real(v) for k, v in kwargs_meta}
            with _quiet_stderr():
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                    out = func(*args, **kwargs)
            return max(0, _allocator_peak(prof) - _returned_bytes(out))
    finally:
        if collecting:
            gc.enable()


def conv_scratch(func, args, kwargs) -> int:
    """Rule 3's figure for one call (module docstring): measured once, then kept."""
    try:
        args_meta = _meta(tuple(args))
        kwargs_meta = tuple(sorted((k, _meta(v)) for k, v in kwargs.items()))
    except _NotMeasured:
        return 0
    key = (func, args_meta, kwargs_meta, _switches())
    held = _kept.get(key)
    if held is None:
        if _profiling():
            return 0
        try:
            held = measured_conv_scratch(func, args_meta, kwargs_meta)
        except Exception:          # the real kernel refuses these operands: it holds nothing
            held = 0
        _kept[key] = held
    return held
