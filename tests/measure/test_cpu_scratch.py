"""The CPU kernels' own buffers (measure._cpu_scratch), against the CPU allocator's events.

Each case runs the real kernel under ``torch.profiler`` (``profile_memory``): the peak of its
allocations, less the bytes of what it returns, is what it held for itself, and must equal the
rule's figure (bf16's backward: at least it, the small per-block buffers the rule leaves out
being less than three outputs).

Convolution's rule (Rule 3) measures the kernel itself, so its cases hand the rule fakes, as a
trace does, and hold its figure to the real kernel run on the real tensors: what they check is
that the operands are rebuilt as they lie (strides, offsets, dtypes), that the figure is kept
per thread count, that the CPU kernels' buffers are not counted for a GPU target, that the
measurement is no op of the trace and leaves a user's profile alone, and that the counter
holds the figure while the op runs."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memfit.measure._cpu_scratch import scratch_bytes
from tests.trace._compiled_oracle import allocator_peak

aten = torch.ops.aten
FW = aten._scaled_dot_product_flash_attention_for_cpu.default
BW = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _held_beside_outputs(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return allocator_peak(prof) - sum(t.untyped_storage().nbytes() for t in out if t is not None)


@pytest.mark.parametrize("shape,dtype,threads,causal", [
    ((2, 4, 32, 16), torch.float32, 2, True),
    ((1, 2, 200, 64), torch.float32, 1, True),
    ((1, 1, 800, 16), torch.float16, 2, True),
    ((1, 2, 256, 32), torch.bfloat16, 2, True),
])
@pytest.mark.parametrize("grad_layout", ["BLHE", "BHLE"])
def test_flash_attention_on_the_cpu_holds_what_the_rule_says(shape, dtype, threads, causal,
                                                            grad_layout):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
        args = (q, k, v, 0.0, causal)
        assert _held_beside_outputs(lambda: FW(*args)) == scratch_bytes(FW, args, {})
        out, lse = FW(*args)
        b, h, n, e = shape
        grad = torch.randn(b, n, h, e, dtype=dtype).transpose(1, 2) \
            if grad_layout == "BLHE" else torch.randn(shape, dtype=dtype)
        bw_args = (grad, q, k, v, out, lse, 0.0, causal)
        held, rule = _held_beside_outputs(lambda: BW(*bw_args)), scratch_bytes(BW, bw_args, {})
        if dtype == torch.bfloat16:       # its per-block buffers are not counted (the rule says)
            assert rule <= held < rule + 3 * out.untyped_storage().nbytes()
        else:
            assert held == rule
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("op", [aten._softmax.default, aten._log_softmax.default])
@pytest.mark.parametrize("layout,dim", [("contiguous", 1), ("channels_last", 1),
                                        ("channels_last", -1), ("transposed", 0)])
def test_softmax_on_the_cpu_holds_a_contiguous_copy_of_a_strided_input(op, layout, dim):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, 8)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "transposed":
        x = torch.randn(64, 32).t()
    held = _held_beside_outputs(lambda: (op(x, dim, False),))
    assert held == scratch_bytes(op, (x, dim, False), {}) == \
        (0 if layout == "contiguous" else x.numel() * x.element_size())
    out = op(x, dim, False)
    backward = aten._softmax_backward_data.default if op is aten._softmax.default else \
        aten._log_softmax_backward_data.default
    for grad in (torch.randn_like(out), torch.randn_like(x)):   # contiguous, and as x lies
        for output in (out, out.clone(memory_format=torch.channels_last)
                       if out.dim() == 4 else out.t().contiguous().t()):
            args = (grad, output, dim, x.dtype)
            held = _held_beside_outputs(lambda: (backward(*args),))
            assert held == scratch_bytes(backward, args, {}), (grad.stride(), output.stride())


def test_other_ops_and_devices_hold_nothing_extra():
    x = torch.randn(4, 4)
    assert scratch_bytes(aten.mm.default, (x, x), {}) == 0
    meta = torch.randn(1, 1, 8, 8, device="meta")
    assert scratch_bytes(FW, (meta, meta, meta, 0.0, False), {}) == 0


# Rule 3: convolution, measured on its kernel. Each case: input, weight, stride, padding,
# groups, dtype, layout, bias, whether the input gets a gradient, threads (1 and 2 each)
CONV = aten.convolution.default
CONV_BW = aten.convolution_backward.default
_CONV_CASES = {
    "vit-patch": ((2, 3, 32, 32), (64, 3, 8, 8), 8, 0, 1, torch.float32, "contiguous", True,
                  False),
    "vit-patch-input-grad": ((2, 3, 32, 32), (64, 3, 8, 8), 8, 0, 1, torch.float32,
                             "contiguous", True, True),
    "vit-patch-inductor": ((2, 3, 32, 32), (64, 3, 8, 8), 8, 0, 1, torch.float32, "sequence",
                           True, False),
    "vit-patch-bf16": ((2, 3, 32, 32), (64, 3, 8, 8), 8, 0, 1, torch.bfloat16, "contiguous",
                       True, True),
    "3x3-channels-last": ((2, 16, 16, 16), (32, 16, 3, 3), 1, 1, 1, torch.float32,
                          "channels_last", False, True),
    "convnext-depthwise": ((2, 32, 16, 16), (32, 1, 7, 7), 1, 3, 32, torch.float32,
                           "contiguous", True, True),
    "convnext-depthwise-channels-last": ((2, 32, 16, 16), (32, 1, 7, 7), 1, 3, 32,
                                         torch.float32, "channels_last", True, True),
    "depthwise-bf16": ((2, 32, 16, 16), (32, 1, 7, 7), 1, 3, 32, torch.bfloat16,
                       "contiguous", True, False),
    "grouped-fp64": ((2, 4, 8, 8), (6, 2, 3, 3), 1, 1, 2, torch.float64, "contiguous", True,
                     True),
    "conv1d": ((2, 8, 50), (16, 8, 5), 1, 2, 1, torch.float32, "contiguous", False, True),
    "conv3d": ((1, 4, 8, 8, 8), (8, 4, 3, 3, 3), 1, 1, 1, torch.float32, "contiguous", True,
               True),
    "conv3d-channels-last": ((1, 4, 8, 8, 8), (8, 4, 3, 3, 3), 2, 1, 1, torch.float32,
                             "channels_last", True, False),
}


def _conv_operands(case):
    """Real (input, weight, bias, grad_output, conv args) of a case; "sequence": the layout
    Inductor gives ViT's patch embedding (channels_last operands, the gradient a slice of the
    sequence's, after the class token)."""
    shape, wshape, s, p, g, dtype, layout, bias, _ = case
    torch.manual_seed(0)
    d = len(shape) - 2
    x, w = torch.randn(shape, dtype=dtype), torch.randn(wshape, dtype=dtype)
    if layout in ("channels_last", "sequence"):
        fmt = torch.channels_last if d == 2 else torch.channels_last_3d
        x, w = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
    b = torch.randn(wshape[0], dtype=dtype) if bias else None
    conv_args = ([s] * d, [p] * d, [1] * d, False, [0] * d, g)
    y = CONV(x, w, b, *conv_args)
    if layout == "sequence":
        n, c, h, wd = y.shape
        grad = torch.randn(n, 1 + h * wd, c, dtype=dtype)[:, 1:].transpose(1, 2).unflatten(
            2, (h, wd))
        assert grad.stride() == (c * (1 + h * wd), 1, wd * c, c) and grad.storage_offset() == c
    else:
        grad = torch.randn_like(y)
    return x, w, b, grad, conv_args


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _faked(*args):
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    return mode, tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("name", list(_CONV_CASES))
def test_convolution_on_the_cpu_holds_what_its_kernel_holds(name):
    """The rule, handed fakes as a trace hands them (it rebuilds the operands from their
    metadata), equals the real kernel on real tensors, forward and backward, at 2 threads then
    1 (the figure is kept per thread count: oneDNN's scratchpads are per thread)."""
    case = _CONV_CASES[name]
    input_grad = case[-1]
    before = torch.get_num_threads()
    figures = {}
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            x, w, b, grad, conv_args = _conv_operands(case)
            fw_args = (x, w, b, *conv_args)
            bw_args = (grad, x, w, None if b is None else [w.shape[0]], *conv_args,
                       [input_grad, True, b is not None])
            for op, args in ((CONV, fw_args), (CONV_BW, bw_args)):
                mode, fakes = _faked(*args)
                with mode:
                    rule = scratch_bytes(op, fakes, {})
                held = _held_beside_outputs(lambda: _as_tuple(op(*args)))
                assert rule == held, (op, threads)
                figures[op, threads] = held
    finally:
        torch.set_num_threads(before)
    if name == "vit-patch-inductor":
        # Conv.cpp's own copies, whatever the ISA: the gradient made channels_last (8,192), the
        # weight and bias gradients in oneDNN's format (49,152 + 256), the dense weight
        # gradient before its .to(ChannelsLast) (49,152)
        assert figures[CONV_BW, 2] >= 8192 + 49152 + 256 + 49152
    if name == "convnext-depthwise":      # per-thread buffers: the thread count changes it
        assert figures[CONV_BW, 2] != figures[CONV_BW, 1]


def test_what_eager_and_transposed_convolutions_dispatch_is_the_rule_s():
    """F.conv1d/2d/3d and conv_transpose2d reach dispatch as ``convolution`` and
    ``convolution_backward``, and the rule counts what those hold."""
    from torch.nn import functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "conv" in str(func):
                self.calls.append((func, args, kwargs, scratch_bytes(func, args, kwargs)))
            return func(*args, **kwargs)

    torch.manual_seed(0)
    cases = [(F.conv1d, (2, 8, 50), (16, 8, 5), {}), (F.conv2d, (2, 3, 32, 32), (64, 3, 8, 8),
                                                      {"stride": 8}),
             (F.conv3d, (1, 4, 8, 8, 8), (8, 4, 3, 3, 3), {"padding": 1}),
             (F.conv_transpose2d, (2, 8, 8, 8), (8, 4, 3, 3), {"stride": 2})]
    for fn, shape, wshape, kw in cases:
        x = torch.randn(shape, requires_grad=True)
        w = torch.randn(wshape, requires_grad=True)
        with Seen() as seen:
            fn(x, w, **kw).sum().backward()
        assert [c[0] for c in seen.calls] == [CONV, CONV_BW], fn
        for func, args, kwargs, rule in seen.calls:
            held = _held_beside_outputs(lambda: _as_tuple(func(*args, **kwargs)))
            assert rule == held > 0, (fn, func)


def test_a_gpu_target_s_trace_counts_no_cpu_flash_attention():
    """Rule 1's kernel is a CPU one too: a GPU target's trace (Inductor's CPU code calls it for
    a compiled model) counts none of it; a CPU target's and real CPU tensors count it."""
    from memfit.measure._cpu_scratch import target

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16) for _ in range(3))
    args = (q, k, v, 0.0, True)
    held = _held_beside_outputs(lambda: FW(*args))
    mode, fakes = _faked(*args)
    with mode:
        assert scratch_bytes(FW, fakes, {}, target="cuda") == 0
        assert scratch_bytes(FW, fakes, {}) == held > 0
        with target("cuda"):
            assert scratch_bytes(FW, fakes, {}) == 0
    with target("cuda"):
        assert scratch_bytes(FW, args, {}) == held


def test_a_gpu_target_s_trace_counts_no_cpu_convolution():
    """A trace's fakes are CPU tensors for every target: only a CPU target's (the default, or
    ``target("cpu")``) counts the CPU kernel's buffers; real CPU tensors run on the CPU."""
    from memfit.measure._cpu_scratch import target

    x, w, b, grad, conv_args = _conv_operands(_CONV_CASES["vit-patch-input-grad"])
    args = (grad, x, w, [64], *conv_args, [True, True, True])
    held = _held_beside_outputs(lambda: CONV_BW(*args))
    mode, fakes = _faked(*args)
    with mode:
        assert scratch_bytes(CONV_BW, fakes, {}, target="cuda") == 0
        assert scratch_bytes(CONV_BW, fakes, {}, target="cpu") == held > 0
        with target("cuda"):
            assert scratch_bytes(CONV_BW, fakes, {}) == 0
            with target("cpu"):
                assert scratch_bytes(CONV_BW, fakes, {}) == held
            assert scratch_bytes(CONV_BW, fakes, {}) == 0
        assert scratch_bytes(CONV_BW, fakes, {}) == held
    with target("cuda"):
        assert scratch_bytes(CONV_BW, args, {}) == held


def test_the_rule_measures_outside_every_mode_and_never_inside_a_profile():
    """The measurement is no op of the trace: a dispatch mode around it sees nothing, and the
    trace's fake mode is on again after it. Inside a user's memory profile it cannot start its
    own (stopping it would end the user's): an unmeasured call holds 0 there, a measured one
    keeps its figure, and the user's profile still records what follows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memfit.measure._cpu_conv_scratch import _kept

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    x, w, b, grad, conv_args = _conv_operands(_CONV_CASES["3x3-channels-last"])
    args = (x, w, b, *conv_args)
    held = _held_beside_outputs(lambda: (CONV(*args),))
    _kept.clear()
    mode, fakes = _faked(*args)
    with mode, Ops() as seen:
        assert scratch_bytes(CONV, fakes, {}) == held > 0
        assert isinstance(torch.empty(1), torch._subclasses.fake_tensor.FakeTensor)
    assert seen.ops == [aten.empty.memory_format]
    odd = (torch.randn(1, 16, 9, 9), w, None, *conv_args)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        assert scratch_bytes(CONV, odd, {}) == 0           # not measured in there
        assert scratch_bytes(CONV, args, {}) == held       # measured before
        torch.empty(12345, dtype=torch.uint8)
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert 12345 in sizes
    assert scratch_bytes(CONV, odd, {}) == _held_beside_outputs(lambda: (CONV(*odd),)) > 0


def test_the_tracker_holds_the_convolution_s_buffers_while_it_runs():
    """``measure._counting`` adds the figure as a transient for the op: a tracked backward of
    the patch embedding peaks at its operands, its outputs and what its kernel held."""
    import memfit

    x, w, b, grad, conv_args = _conv_operands(_CONV_CASES["vit-patch"])
    args = (grad, x, w, [64], *conv_args, [False, True, True])
    held = _held_beside_outputs(lambda: CONV_BW(*args))
    with memfit.track() as t:
        out = CONV_BW(*args)
    operands = sum(a.untyped_storage().nbytes() for a in (grad, x, w))
    outputs = sum(o.untyped_storage().nbytes() for o in out if o is not None)
    assert held > 0 and t.peak_bytes == operands + outputs + held


def test_only_a_cpu_target_s_estimate_runs_the_convolution_kernel(monkeypatch):
    """``estimate`` for a GPU target runs no CPU kernel (api._traced says its target): the
    rule is never asked to measure there, while a CPU target's estimate of the same model is
    higher by what the kernels hold."""
    import memfit
    from memfit.measure import _cpu_conv_scratch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 4, 3, padding=1))
    batch = torch.randn(4, 3, 16, 16)
    loss = lambda m, b: m(b).sum()          # noqa: E731
    _cpu_conv_scratch._kept.clear()
    measured = []
    real = _cpu_conv_scratch.measured_conv_scratch
    monkeypatch.setattr(_cpu_conv_scratch, "measured_conv_scratch",
                        lambda *a: measured.append(a[0]) or real(*a))
    gpu = memfit.estimate(model, batch, device="rtx-4090", loss_fn=loss,
                          allocator_replay=False)
    assert measured == [] and gpu.peak_bytes > 0
    plain = memfit.estimate(model, batch, loss_fn=loss)
    assert set(measured) == {aten.convolution.default, aten.convolution_backward.default}
    monkeypatch.setattr(_cpu_conv_scratch, "conv_scratch", lambda *a: 0)
    monkeypatch.setattr("memfit.measure._cpu_scratch.conv_scratch", lambda *a: 0)
    assert plain.peak_bytes > memfit.estimate(model, batch, loss_fn=loss).peak_bytes
