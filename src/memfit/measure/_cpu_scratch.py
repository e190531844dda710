"""Buffers a CPU kernel allocates for itself and frees before it returns.

A dispatch mode sees the tensors an op returns, not the ``at::empty`` a C++ kernel makes for its
own work, yet the allocator holds those while the kernel runs, beside its outputs. The counter
adds them as a transient for the op's duration (``Ledger.transient``) where the kernel's sizes
are known. Each rule names the kernel and was checked against the CPU allocator's own events
(``torch.profiler`` with ``profile_memory``; tests/measure/test_cpu_scratch.py).

Rule 1 (flash attention on the CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``, what SDPA runs on CPU tensors
without a mask, and what Inductor calls for it). The query is split in blocks of 32 rows (64
from 192 rows, 256 from 768), the keys in blocks of 512; ``q``, ``kv`` are those block sizes
capped at the lengths. Per thread (``torch.get_num_threads()``) the forward holds, in fp32 (fp64
for fp64 inputs), ``q * kv`` scores, ``2 q`` running max and sum and ``q * Ev`` output rows, and
for a 16-bit input ``q * kv`` more in its dtype; the backward holds ``2 q * kv`` (attention and
its gradient) in fp32, the same again in a 16-bit input's dtype, ``q`` more in fp32 while it
reduces, and a copy of the incoming gradient in the (B, L, H, E) layout it reads, unless it is
laid out so already (as the gradient reshaped from an output projection's is). A bf16
backward also makes per-block buffers one at a time (83,716 bytes for 256 rows of 32 values
and 2 heads), not counted.

Rule 2 (softmax: ``_softmax`` and ``_log_softmax``, ``host_softmax`` in
``aten/src/ATen/native/SoftMax.cpp``). The kernel reads its input as ``input.contiguous()``: an
input that is not contiguous (a channels_last segmentation logit, a transposed score) is copied
whole, in its dtype, and the copy freed when the kernel returns (found on SegFormer, 1.2% under
the real step without it). Their backward kernels read the incoming gradient and the output so,
each copied where it is not contiguous. CUDA's ``host_softmax`` (``SoftMax.cu``) reads them the
same way, so a GPU target's trace, whose fakes are CPU tensors too, counts the copies (read from
the source; not measured on a GPU).

Rule 3 (convolution: ``convolution`` and ``convolution_backward``, what ``F.conv1d``/``conv2d``/
``conv3d`` and their transposes reach dispatch as, eagerly and from Inductor's generated code).
``_select_conv_backend`` (``aten/src/ATen/native/Convolution.cpp``) sends a CPU float or bf16
convolution to oneDNN (``mkldnn_convolution`` and ``mkldnn_convolution_backward`` in
``aten/src/ATen/native/mkldnn/Conv.cpp``), and fp64 and some small shapes to the im2col kernels
(``slow_conv2d`` in ``ConvolutionMM2d.cpp``, ``slow_conv3d``), which hold a ``columns`` buffer.
oneDNN's path holds: each operand's ``contiguous(memory_format)`` copy where it is not so laid
out (a gradient sliced from a sequence, as ViT's patch embedding gets it); reorders of the
input, weight and gradient into the primitive's blocked formats (channels padded to the ISA's
block, 16 on AVX-512, 8 on AVX2); the weight and bias gradients computed in oneDNN's format and
then copied to dense tensors, and for a channels_last weight copied once more by
``.to(ChannelsLast)``; and oneDNN's scratchpad, whose size depends on the jit kernel chosen, the
ISA and the thread count. The blocked formats alone make the sizes ISA-specific: the patch
embedding's 64 x 3 x 8 x 8 weight is reordered with its 3 input channels padded to 16 (262,144
bytes for 49,152) for the input gradient, and a channels_last depthwise 7 x 7 (32 groups)
computes its weight gradient with each group's 1 x 1 channels padded to 16 x 16 (1,605,632 bytes
for 6,272; ``ONEDNN_VERBOSE=1`` names the formats). These cannot be derived portably from the
source, so the rule measures them: the real kernel runs once at the traced metadata (fresh
tensors of the same sizes, strides, offset and dtype) under ``torch.profiler``, and the peak of
the allocator's events less its outputs is the figure, kept per op, metadata, thread count and
oneDNN's switches (``measure._cpu_conv_scratch``). ViT's patch embedding backward compiled by
Inductor (channels_last operands, a strided gradient, no input gradient) holds 106,752 bytes
beside its 49,408 of outputs: an 8,192 gradient copy, the weight and bias gradients in oneDNN's
format (49,152 + 256) and the dense weight gradient before its channels_last copy (49,152).
Checked against the allocator's events on 1-3-d, strided, transposed, channels_last, grouped and
depthwise convolutions, fp32, bf16 and fp64, with and without bias and input gradient, at 1 and 2
threads. Only a CPU target runs these kernels: a trace for a GPU target, whose fakes are CPU
tensors too, says so with ``target("cuda")`` around it, and Rules 1 and 3 add nothing there (a
trace that says nothing is taken as a CPU target's).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.measure._cpu_conv_scratch import CONV_OPS, conv_scratch

__all__ = ["scratch_bytes", "target"]

_aten = torch.ops.aten
_FLASH_FW = _aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BW = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_REDUCED = (torch.float16, torch.bfloat16)


def _splits(q_len: int, kv_len: int) -> tuple[int, int]:
    q_split = 256 if q_len >= 768 else 64 if q_len >= 192 else 32
    return min(q_split, q_len), min(512, kv_len)


def _accumulate_size(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4


def _flash_forward(query, key, value, *args, **kwargs) -> int:
    q, kv = _splits(query.size(2), key.size(2))
    threads = torch.get_num_threads()
    acc = threads * (q * kv + 2 * q + q * value.size(3)) * _accumulate_size(query.dtype)
    reduced = threads * q * kv * query.element_size() if query.dtype in _REDUCED else 0
    return acc + reduced


def _flash_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    q, kv = _splits(query.size(2), key.size(2))
    threads = torch.get_num_threads()
    acc_size = _accumulate_size(query.dtype)
    acc = threads * 2 * q * kv * acc_size + q * acc_size
    reduced = threads * 2 * q * kv * query.element_size() if query.dtype in _REDUCED else 0
    copy = 0 if grad_out.transpose(1, 2).is_contiguous() else \
        grad_out.numel() * grad_out.element_size()
    return acc + reduced + copy


def _copied(*tensors) -> int:
    """Bytes of ``t.contiguous()`` for each tensor that is not (Rule 2)."""
    return sum(0 if t.is_contiguous() else t.numel() * t.element_size() for t in tensors)


def _softmax(x, *args, **kwargs) -> int:
    return _copied(x)


def _softmax_backward(grad, output, *args, **kwargs) -> int:
    return _copied(grad, output)


_RULES = {_FLASH_FW: _flash_forward, _FLASH_BW: _flash_backward,
          _aten._softmax.default: _softmax, _aten._log_softmax.default: _softmax,
          _aten._softmax_backward_data.default: _softmax_backward,
          _aten._log_softmax_backward_data.default: _softmax_backward}


_RULES.update({op: (lambda *args, _op=op, **kwargs: conv_scratch(_op, args, kwargs))
               for op in CONV_OPS})                     # Rule 3, measured on the kernel
# kernels only a CPU target runs: Rules 1 and 3 (a GPU target's SDPA and convolution are its
# own kernels; Inductor's CPU code for a GPU target's compiled trace calls the CPU flash one)
_CPU_ONLY = frozenset({_FLASH_FW, _FLASH_BW, *CONV_OPS})
_target = threading.local()


@contextlib.contextmanager
def target(kind: str):
    """Inside, a trace estimates a step on a ``kind`` device ("cpu", "cuda"): its fakes are CPU
    tensors for every target, and only a CPU target runs the CPU kernels of Rules 1 and 3."""
    before = getattr(_target, "kind", None)
    _target.kind = kind
    try:
        yield
    finally:
        _target.kind = before


def scratch_bytes(func, args, kwargs, target: str | None = None) -> int:
    """The bytes ``func``'s kernel allocates and frees inside the call (the rules above), 0 for
    any other op, or a tensor on another device than the CPU (a trace's fakes are CPU tensors
    for every target). ``target``: the device a trace of fakes estimates for (default: the
    one ``target()`` says, else the CPU); real tensors run where they are."""
    rule = _RULES.get(func)
    if rule is None or not args or not isinstance(args[0], torch.Tensor) or \
            args[0].device.type != "cpu":
        return 0
    if func in _CPU_ONLY and isinstance(args[0], FakeTensor) and \
            (target or getattr(_target, "kind", None) or "cpu") != "cpu":
        return 0
    return int(rule(*args, **kwargs))
