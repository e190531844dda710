"""The planner's time model: the seconds of a step on a device, from the ops of one trace.

Note 1 (an op's time). ``launch + flops / (F * 0.6) + bytes / (B * 0.8)``: ``F`` the device's peak
rate at the precision, ``B`` its memory bandwidth, the factors typical achieved fractions
(large matmuls reach ~60-70% of peak, streaming kernels ~80% of bandwidth). Adding the compute
and memory terms instead of taking their maximum over-counts ops that are neither clearly bound,
equally in every plan: the planner compares plans by their ratio. Bytes are what the op read and
wrote (``measure._counting._touched_bytes``), so pointwise ops cost bandwidth, not FLOPs.

Note 2 (precision). fp16/bf16 matmuls accumulate in fp32; a card whose 16-bit rate is below its
fp32 rate (no tensor cores, e.g. Pascal) runs them at its fp32 rate (cuBLAS computes in fp32), so
``F`` is the larger of the two. Halved activation bytes come from the trace itself.

Note 3 (the micro-batch). Each op's time splits as the memory model splits its bytes: launch and
state bytes (weights read, gradients written) once per micro-batch, FLOPs and activation bytes
per sample. ``n`` micro-batches of an effective batch ``b`` cost ``n * state + b * per-sample``:
the per-micro-batch overhead is the launches and weight traffic repeated ``n`` times.

Note 4 (modes). ``recompute`` reruns the ops of the block's forward; ``selective`` only those that
are not matmul-like. ``offload`` moves the bytes it saves over the host link both ways; the copy out
overlaps the next block's forward and the prefetch the previous block's backward, so only the part
of each transfer longer than the block's own compute is paid, plus the device-side read of the copy
(on a CPU target, with no copy streams, the whole transfer). With the optimizer state on the host,
the optimizer step becomes gradients down and parameters up over the link plus the host's pass over
the state at its memory bandwidth, all paid (the step waits for it), and never less than the step on
the device (a host cannot out-run the device it serves; on a CPU target they are the same memory).

Note 5 (the baseline). The step-time ratio is against the user's own step: the plain step at the
user's precision (fp32 under "auto"), traced once and timed by a model of its own (the plan traces
it beside its candidate precisions). Where a plan changes the precision, a ratio below 1 is a
speed-up.

Note 6 (the optimizer implementation). ``with_optimizer_step(est)`` times the optimizer step
from the ops of ``est``, a plain trace with another implementation (foreach: a few kernels
over all parameters; fused: one per group; for-loop: one set per parameter, so its launches
count); the forward and backward are this model's.

Note 7 (parameter offload). A model read off a trace with ``offload_params`` already counts the
fetches' device-side copies (ops of the trace); what it adds is the host link: every offloaded
weight crosses it before the block's forward and again before its backward, once per
micro-batch, and the copies are synchronous (no side stream yet): nothing hides them.
``with_fetches(bytes)`` adds ``bytes / link`` per micro-batch.

Note 8 (low-bit optimizer state). Its step (dequantize, Adam, quantize: the library's ops) is
timed from the ops of a trace with that state (``with_optimizer_step``, as Note 6).

Note 9 (gradients to the host as they are made). A model read off a trace with
``offload_gradients`` has no gradients on the device at its optimizer step, so the bytes the
link carries come from the plain model (``with_gradient_offload(bytes)``): the gradients go down
in every micro-batch's backward, on the compute stream (nothing hides them), a micro-batch after
the first adds its gradients to the host's (a pass over both at the host's bandwidth), and the
step sends the parameters up, with the host's pass over the state as in Note 4.
"""

from __future__ import annotations

import copy

import numpy as np

from memfit.devices import DeviceSpec, cpu_spec
from memfit.modes import Mode
from memfit.planner.memory_model import MemoryModel, is_saved_op

__all__ = ["TimeModel", "FLOP_EFFICIENCY", "BANDWIDTH_EFFICIENCY"]

FLOP_EFFICIENCY = 0.6
BANDWIDTH_EFFICIENCY = 0.8
# per op: kernel launch on a GPU; on a CPU the eager dispatcher and Python module overhead
# (~40 us per op, read off benchmarks/planner_vs_recipes.py's micro-batch-1 rows)
_LAUNCH_S = {"cuda": 5e-6, "cpu": 4e-5}


def flop_rate(spec: DeviceSpec, precision: str) -> float:
    """FLOP/s a matmul reaches at ``precision`` (Note 2)."""
    fp32 = spec.peak_fp32_flops
    if precision.startswith("bf16"):
        return max(spec.peak_bf16_flops, fp32)
    if precision == "fp16":
        return max(spec.peak_fp16_flops, fp32)
    return fp32


class TimeModel:
    """Predicted step time of one precision's trace on ``spec`` (Notes)."""

    def __init__(self, est, spec: DeviceSpec, precision: str, batch_size: int,
                 memory: MemoryModel, half=None):
        """``est``/``half``: the plain traces at ``batch_size`` and ``batch_size // 2`` (the
        same two the memory model reads; ``half`` optional, Note 3)."""
        self.spec, self.memory, self.b0 = spec, memory, batch_size
        costs = _costs(est)
        f = flop_rate(spec, precision) * FLOP_EFFICIENCY
        bw = spec.memory_bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY
        launch = _LAUNCH_S.get(spec.kind, 5e-6)
        self._rates = (f, bw, launch)
        flops, touched, state = costs[:, 0], costs[:, 1], costs[:, 2]
        if half is not None and len(half.op_costs) == len(est.op_costs) and batch_size > 1:
            slope = (costs - _costs(half)) / (batch_size - batch_size // 2)
            fixed = costs - slope * batch_size
            self._fixed = launch + fixed[:, 0] / f + fixed[:, 1] / bw      # per micro-batch
            self._per = slope[:, 0] / f + slope[:, 1] / bw                # per sample
        else:
            self._fixed = launch + state / bw
            self._per = (flops / f + (touched - state) / bw) / self.b0
        self._matmul = np.array([is_saved_op(op) for op in est.op_log], dtype=bool)
        self.opt_start = memory.opt_start
        self._opt_touched = float(touched[self.opt_start:].sum())
        self.optimizer_s = float(self._fixed[self.opt_start:].sum() + self._per[self.opt_start:].sum()
                                 * self.b0)
        # per block, its passes: (unit, forward ops, backward ops), a forward paired with the
        # backward that follows it (a user's step may run a block several times)
        self._passes = [[(u, _span(fw), _span(bw)) for u, fw, bw in memory.passes(i)]
                        for i in range(len(memory.blocks))]

    fetch_s: float = 0.0           # host-link seconds per micro-batch (Note 7)
    grads_to_host_bytes: float = 0.0   # gradients sent down in each backward (Note 9)

    def with_gradient_offload(self, grads_bytes: float) -> "TimeModel":
        """This model with ``grads_bytes`` of gradients moved to the host in each micro-batch's
        backward (Note 9)."""
        out = copy.copy(self)
        out.grads_to_host_bytes = float(grads_bytes)
        return out

    def gradients_down_s(self, n: int) -> float:
        """What moving the gradients to the host adds to ``n`` micro-batches (Note 9)."""
        if not self.grads_to_host_bytes:
            return 0.0
        host = cpu_spec().memory_bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY
        g = self.grads_to_host_bytes
        return n * g / self.spec.host_link_bytes_per_s + (n - 1) * 3 * g / host

    def with_fetches(self, bytes_per_micro_batch: float) -> "TimeModel":
        """This model with ``bytes_per_micro_batch`` fetched over the host link (Note 7)."""
        out = copy.copy(self)
        out.fetch_s = float(bytes_per_micro_batch) / self.spec.host_link_bytes_per_s
        return out

    def with_optimizer_step(self, est) -> "TimeModel":
        """This model with the optimizer step timed from ``est`` (Note 6)."""
        out = copy.copy(self)
        f, bw, launch = self._rates
        start = est.phases.get("optimizer", len(est.op_costs))
        costs = _costs(est)[start:]
        out.optimizer_s = float((launch + costs[:, 0] / f + costs[:, 1] / bw).sum())
        out._opt_touched = float(costs[:, 1].sum())
        return out

    def with_optimizer_touching(self, touched: float) -> "TimeModel":
        """This model with an optimizer step of one op that reads and writes ``touched``
        bytes and computes nothing: the least a step touching at least that much is timed
        (Note 1: an op's time grows with its launches, FLOPs and bytes), the bound of an
        implementation not traced yet (``api._plan_deferred``)."""
        out = copy.copy(self)
        f, bw, launch = self._rates
        out.optimizer_s = float(launch + touched / bw)
        out._opt_touched = float(touched)
        return out

    def with_optimizer_of(self, variant: "TimeModel") -> "TimeModel":
        """This model with the optimizer step of ``variant`` (another implementation or state
        of the same optimizer, Notes 6 and 8); the forward and backward are this model's."""
        out = copy.copy(self)
        out.optimizer_s, out._opt_touched = variant.optimizer_s, variant._opt_touched
        return out

    def _cost(self, sl: slice, n: int, b: int, mask=None) -> float:
        fixed, per = self._fixed[sl], self._per[sl]
        if mask is not None:
            fixed, per = fixed[mask[sl]], per[mask[sl]]
        return float(n * fixed.sum() + b * per.sum())

    def forward_backward_s(self, n: int, b: int) -> float:
        """The plain forward and backward of ``n`` micro-batches over ``b`` samples."""
        return self._cost(slice(0, self.opt_start), n, b)

    def mode_s(self, i: int, mode: Mode, m: int, n: int, b: int) -> float:
        """What block ``i`` in ``mode`` adds to the step (Note 4), summed over its passes."""
        if mode == Mode.KEEP:
            return 0.0
        if mode == Mode.RECOMPUTE:
            return sum(self._cost(fw, n, b) for _, fw, _ in self._passes[i])
        if mode == Mode.SELECTIVE:
            return sum(self._cost(fw, n, b, ~self._matmul) for _, fw, _ in self._passes[i])
        total = 0.0
        for u, fw, bw in self._passes[i]:
            moved = self.memory.unit_saved_bytes(u, Mode.OFFLOAD, m)             # bytes each way
            link = moved / self.spec.host_link_bytes_per_s
            fw_s, bw_s = self._cost(fw, 1, m), self._cost(bw, 1, m)
            read = moved / (self.spec.memory_bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY)
            if self.spec.kind != "cuda":          # no copy streams: nothing hides a transfer
                fw_s = bw_s = 0.0
            total += max(link - fw_s, 0.0) + max(link - bw_s, 0.0) + 2 * read
        return total * b / m

    def optimizer_step_s(self, offload_optimizer: bool) -> float:
        if not offload_optimizer:
            return self.optimizer_s
        host = cpu_spec().memory_bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY
        # gradients down, parameters up (same size); gradients already down: parameters (Note 9)
        moved = self.grads_to_host_bytes or self.memory.grads_bytes * 2
        on_host = moved / self.spec.host_link_bytes_per_s + self._opt_touched / host
        return max(on_host, self.optimizer_s)        # never faster than on the device (Note 4)

    def step_s(self, m: int, b: int, modes, offload_optimizer: bool) -> float:
        n = -(-b // m)
        return (self.forward_backward_s(n, b) + n * self.fetch_s + self.gradients_down_s(n)
                + sum(self.mode_s(i, mode, m, n, b) for i, mode in enumerate(modes))
                + self.optimizer_step_s(offload_optimizer))


def _costs(est) -> np.ndarray:
    return np.asarray(est.op_costs, dtype=np.float64).reshape(-1, 4)


def _span(span) -> slice:
    return slice(span[0], span[1] + 1)
