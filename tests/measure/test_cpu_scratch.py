"""The CPU kernels' own buffers (measure._cpu_scratch), against the CPU allocator's events.

Each case runs the real kernel under ``torch.profiler`` (``profile_memory``): the peak of its
allocations, less the bytes of what it returns, is what it held for itself, and must equal the
rule's figure (bf16's backward: at least it, the small per-block buffers the rule leaves out
being less than three outputs)."""

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
    return allocator_peak(prof) - sum(t.untyped_storage().nbytes() for t in out)


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
