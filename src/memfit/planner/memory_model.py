"""The planner's memory model: the device bytes of a step under any mix of per-block modes.

Note 1 (one trace). The model is read off one plain trace of the step (one precision, the whole
effective batch as one micro-batch, nothing recomputed or offloaded): its live-bytes timeline by
category, each block's saved and input bytes, the op spans of each block's forward and backward,
and the bytes each op allocated. Every other configuration is predicted from it; the planner then
re-traces the configuration it picks (a miss lowers the cap and searches again,
docs/planner.md), so an error here costs speed, not safety.

Note 2 (the micro-batch). Bytes split three ways: a part that does not depend on the batch
(training state, and what is computed from state alone: 16-bit weight copies saved by autocast
matmuls, position embeddings), a part that grows with the micro-batch ``m`` (activations,
temporaries) and a part that grows with the effective batch ``b`` (the inputs: the whole batch
stays alive while its micro-batches run). An ``Amount`` is the vector (fixed, per micro-batch
sample, per batch sample), worth ``fixed + m * act + b * inp`` bytes. Two plain traces, at ``b``
and at ``b // 2``, give each point's line exactly (same ops, two batch sizes); with one trace
(``b`` = 1, or the two traces differ in their ops) state is fixed and the rest proportional.

Note 3 (a block's modes). Between the end of its forward and the start of its backward a block
holds its saved bytes S. ``recompute`` keeps only its inputs I (saves S - I); at its backward the
forward reruns, so S comes back plus the forward's temporaries. ``selective`` keeps I plus what
the matmul-like ops (checkpoint's ``SAVED_OPS``) allocated in its forward; the rest comes back in
backward. ``offload`` keeps what ``recompute`` keeps, on the safe side (its input may leave the
device too); at its backward S comes back, and the prefetch of the next block's S rides on top.
A block whose passes the trace cannot pair (Note 8) can only be kept.

Note 4 (where the peak can be). At each block's forward peak, at each block's backward peak,
along every stretch of ops outside the blocks (embeddings, head, loss), and in the optimizer
step. Each such point is ``const - sum(saved by the blocks whose data is pending there) + extra of
the block running there``: linear in the one-hot choice of modes, so a MILP row (planner.search).

Note 5 (accumulation and optimizer offload). With more than one micro-batch, every micro-batch
after the first runs with all gradients alive: each forward/backward point gains the gradients
it did not yet have, unless the model was read off a trace that moves each gradient to the host
as backward makes it (``grads_on_host``: they accumulate there, so every micro-batch is the
first). With the optimizer state on the host, each point loses the optimizer bytes
it held, and the optimizer step on the device holds parameters and gradients only.

Note 6 (allocated vs device bytes). The rows are allocated bytes; on CUDA the traced ratio of
reserved to allocated bytes at the peak, and the CUDA context, turn them into device bytes. On
CUDA the traced allocated peak also counts what the allocator holds for no tensor of the
timeline (the cuBLAS and autograd workspaces, kept from the first matmul: ``trace.cuda``);
``outside_bytes``, the traced peak less the timeline's, is held at every point. Left out, every
prediction was short by them times the ratio (27.6 MB on gpt2 on an RTX 3090: the plain step's
own prediction was not its trace).

Note 7 (the optimizer implementation). foreach, fused and for-loop steps differ only in the
temporaries of the optimizer step (foreach's span all parameters at once).
``with_optimizer_step(est)`` takes them from a trace of the optimizer phase with the other
implementation (``estimate(optimizer_only=True)``, or a whole step): the step's peak above the
level it starts from, which depends on no batch size (state and gradients only); the forward and
backward points stay this model's. With the optimizer state on the host the step runs
there, so that point does not change.

Note 8 (passes). A user's step may run a block several times (micro-batches accumulated inside
the step). Each forward call that saved bytes is paired with the backward that follows it (the
latest unpaired forward ending before the backward starts), and each pair is a *unit* with its
own spans and saved bytes: at a point, the pending units count, each saving what its pass
saved; a block's mode applies to all its passes (block hooks act on every call). Forwards that
saved nothing (under ``no_grad``) are no passes. A block with a forward left without a backward,
or a backward without a forward, or an empty backward window (one layer applied in turn, as
ALBERT's), can only be kept. ``planner._trace_reads.block_passes`` pairs them.

Note 9 (low-bit optimizer state). A low-bit Adam (``optimizer_state``) changes only the
optimizer's bytes: its state, alive at every point, and its step's temporaries (on CPU
parameter-sized fp32 copies; none in bitsandbytes' fused CUDA kernel, which updates in place).
``with_optimizer_state(est)`` reads both off a trace of the optimizer phase with that state
(``estimate(optimizer_only=True)``, or a whole step): the state's bytes when the phase starts
(made before the step, alive and unchanged through forward and backward) beyond this model's
shift every point, and the step's rise replaces this model's (as Note 7).

Note 10 (parameter offload, placements). A model read off a trace with ``offload_params`` (block
weights on the host, fetched per block) is a model like any other, with two limits the search
respects (it asks ``placements`` and ``excluded_modes``): the optimizer state must be on the host
(``placements``: parameter offload needs optimizer offload), and no block may offload its
activations too (``excluded_modes``; the technique refuses it). bf16-pure has one placement too (on
the device: its fp32 master weights would be kept twice). A model read off a trace with the
optimizer stepped in backward holds for the whole batch only (``whole_batch``: its hooks step
each gradient as it is made, so micro-batches cannot accumulate), with the state on the device.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from memfit.techniques.checkpoint import SAVED_OPS
from memfit.modes import Mode
from memfit.planner._trace_reads import block_passes, level_before, optimizer_rise_bytes

__all__ = ["MODES", "MemoryModel", "Rows"]

MODES = (Mode.KEEP, Mode.RECOMPUTE, Mode.SELECTIVE, Mode.OFFLOAD)
_STATE = ("params", "grads", "optimizer", "other")
_ACT = ("activations", "temporaries")
_SAVED_OP_NAMES = {str(op) for op in SAVED_OPS}       # "aten.mm", ...


def is_saved_op(name: str) -> bool:
    """An op of the trace's log ("aten.mm.default") is one selective recompute keeps."""
    return name.rsplit(".", 1)[0] in _SAVED_OP_NAMES


@dataclass
class Rows:
    """Allocated bytes at every candidate peak point: ``const + A @ x`` with ``x`` the one-hot
    modes (block-major, ``MODES`` order). ``labels`` says what each point is."""

    const: np.ndarray      # (points,)
    A: np.ndarray          # (points, blocks * len(MODES))
    labels: list[str]

    def peak(self, x: np.ndarray) -> float:
        return float(np.max(self.const + self.A @ x))


def outside_bytes(est) -> int:
    """Bytes of ``est``'s traced allocated peak that no tensor of its timeline stands for (Note
    6: a GPU trace's workspaces); 0 for a CPU trace."""
    return max(int(est.peak_bytes) - int(max(est.timeline, default=0)), 0)


class MemoryModel:
    """Predicted allocated bytes of a step for any micro-batch and per-block modes (Notes)."""

    placements: tuple[bool, ...] = (False, True)    # where the optimizer state may be (Note 10)
    excluded_modes: tuple[Mode, ...] = ()            # block modes this step refuses (Note 10)
    whole_batch: bool = False                  # the micro-batch must be the batch (Note 10)
    grads_on_host: bool = False                # gradients accumulate on the host (Note 5)

    def __init__(self, est, batch_size: int, half=None):
        """``est``: the plain trace at ``batch_size``; ``half``: the same at ``batch_size // 2``
        (optional, Note 2)."""
        self.b0 = batch_size
        self.blocks = list(est.blocks)
        self.device_ratio = est.reserved_bytes / max(est.peak_bytes, 1)   # Note 6
        self.context_bytes = est.context_bytes
        n = len(est.timeline)
        if half is not None and len(half.timeline) != n:
            half = None
        fit = _Fit(batch_size, batch_size // 2 if half is not None else None)
        cats, hcats = est.timeline_by_category, (half.timeline_by_category if half else None)
        state = _sum(cats, _STATE)
        act, inp = _sum(cats, _ACT), _sum(cats, ("inputs",))
        if hcats is None:
            self._fixed, self._act, self._inp = state, act / self.b0, inp / self.b0
        else:
            hstate, hact, hinp = _sum(hcats, _STATE), _sum(hcats, _ACT), _sum(hcats, ("inputs",))
            a0, self._act = fit.line(state + act, hstate + hact)
            i0, self._inp = fit.line(inp, hinp)
            self._fixed = a0 + i0
        self.outside_bytes = float(outside_bytes(est))                     # Note 6
        self._fixed = self._fixed + self.outside_bytes
        self._grads = np.asarray(cats["grads"], dtype=np.float64)
        self._new_grads = np.diff(self._grads, prepend=self._grads[:1]).clip(min=0.0)
        self._opt = np.asarray(cats["optimizer"], dtype=np.float64)
        self._total = np.asarray(est.timeline, dtype=np.float64) + self.outside_bytes
        self.opt_start = est.phases.get("optimizer", n)
        self.grads_bytes = float(self._grads[self.opt_start]) if self.opt_start < n else 0.0
        self.optimizer_state_bytes = float(self._opt[:self.opt_start].max(initial=0.0))
        params = np.asarray(cats["params"], dtype=np.float64)
        self.params_bytes = float(params[:self.opt_start].max(initial=0.0))
        self._opt_rise: float | None = None          # Note 7
        # one unit per pass of a block: (block, forward span, backward span) (Note 8)
        self._units: list[tuple[int, tuple, tuple]] = []
        self.saved, self.inputs, self.selective_kept = [], [], []     # per unit: (fixed, per sample)
        for i, name in enumerate(self.blocks):
            r, h = est.modules[name], half.modules.get(name) if half is not None else None
            passes = block_passes(r)
            hpasses = block_passes(h) if h is not None else None
            if hpasses is not None and len(hpasses) != len(passes or ()):
                hpasses = None
            for j, (fw, bw, saved) in enumerate(passes or ()):
                hp = hpasses[j] if hpasses else None
                self._units.append((i, fw, bw))
                self.saved.append(fit.pair(saved, hp[2] if hp else None))
                self.inputs.append(fit.pair(r.input_bytes, h.input_bytes if hp else None))
                self.selective_kept.append(fit.pair(
                    _selective_kept(est, r, fw, saved),
                    _selective_kept(half, h, hp[0], hp[2]) if hp else None))
        self._units_of = [[u for u, unit in enumerate(self._units) if unit[0] == i]
                          for i in range(len(self.blocks))]
        self._points = self._build_points(n)

    # -- per block ----------------------------------------------------------------------------
    def allowed(self, i: int) -> tuple[Mode, ...]:
        if not self._units_of[i]:
            return (Mode.KEEP,)
        return tuple(m for m in MODES if m not in self.excluded_modes)

    def limited(self, placements: tuple[bool, ...] | None = None,
                excluded_modes: tuple[Mode, ...] | None = None,
                whole_batch: bool | None = None) -> "MemoryModel":
        """This model with fewer placements, block modes or micro-batches allowed (Note 10)."""
        out = copy.copy(self)
        if whole_batch is not None:
            out.whole_batch = whole_batch
        if placements is not None:
            out.placements = placements
        if excluded_modes is not None:
            out.excluded_modes = excluded_modes
        return out

    def saved_bytes(self, i: int, mode: Mode, m: int) -> float:
        """Bytes block ``i`` no longer holds, at micro-batch ``m``, while its data is pending,
        summed over its passes (the bytes an offload moves each way)."""
        return sum(self.unit_saved_bytes(u, mode, m) for u in self._units_of[i])

    def held_saved_bytes(self, i: int, mode: Mode, m: int) -> float:
        """The most block ``i`` no longer holds at one time (its largest pass)."""
        return max((self.unit_saved_bytes(u, mode, m) for u in self._units_of[i]), default=0.0)

    def passes(self, i: int) -> list[tuple[int, tuple, tuple]]:
        """Block ``i``'s passes: ``(unit, forward span, backward span)`` each (Note 8)."""
        return [(u, self._units[u][1], self._units[u][2]) for u in self._units_of[i]]

    def unit_saved_bytes(self, u: int, mode: Mode, m: int) -> float:
        """What one pass (unit ``u``) of its block no longer holds while its data is pending."""
        if mode == Mode.KEEP:
            return 0.0
        kept = self.selective_kept[u] if mode == Mode.SELECTIVE else self.inputs[u]
        return max(_at(self.saved[u], m) - _at(kept, m), 0.0)

    def _extra_bw(self, u: int, mode: Mode, m: int) -> float:
        """Bytes unit ``u``'s backward holds above the plain one's (Note 3)."""
        if mode == Mode.KEEP:
            return 0.0
        back = self.unit_saved_bytes(u, mode, m)
        if mode == Mode.OFFLOAD:
            return 2 * back                  # its own data back, and the next block's prefetch
        return back + self._fw_temporaries[u] * m

    # -- points (Note 4) --------------------------------------------------------------------
    def _build_points(self, n: int) -> list[tuple]:
        """(label, kind, index or index array, pending units, running unit)."""
        units = self._units
        inside = np.zeros(n, dtype=bool)
        self._fw_temporaries = []
        points = []
        for u, (i, (a, e), (c, d)) in enumerate(units):
            inside[a:e + 1] = True
            inside[c:d + 1] = True
            peak_fw = a + int(np.argmax(self._total[a:e + 1]))
            grow = self._act[e] - self._act[a - 1]                   # per sample
            self._fw_temporaries.append(max(self._act[peak_fw] - self._act[a - 1] - grow, 0.0))
            name = self.blocks[i] if len(self._units_of[i]) == 1 else \
                f"{self.blocks[i]} (pass {self._units_of[i].index(u) + 1})"
            pending = [k for k, o in enumerate(units) if o[1][1] < a and o[2][0] > a]
            points.append((f"forward of {name}", "fw", (a - 1, peak_fw), pending, u))
            pending = [k for k, o in enumerate(units) if o[1][1] < c and o[2][0] >= c]
            peak_bw = c + int(np.argmax(self._total[c:d + 1]))
            points.append((f"backward of {name}", "bw", (c - 1, peak_bw), pending, u))
        # stretches outside every block, grouped by the blocks pending there
        start = None
        key = None
        for t in range(self.opt_start + 1):
            if t < self.opt_start and not inside[t]:
                pend = tuple(k for k, o in enumerate(units) if o[1][1] < t < o[2][0])
                if start is None or pend != key:
                    if start is not None:
                        points.append(("outside the blocks", "seg", np.arange(start, t), list(key),
                                       None))
                    start, key = t, pend
            elif start is not None:
                points.append(("outside the blocks", "seg", np.arange(start, t), list(key), None))
                start = None
        if self.opt_start < n:
            points.append(("optimizer step", "opt", np.arange(self.opt_start, n), [], None))
        return points

    def rows(self, m: int, b: int, accumulate: bool, offload_optimizer: bool) -> Rows:
        """The MILP rows for micro-batch ``m`` of effective batch ``b`` (Notes 4 and 5)."""
        nm = len(MODES)
        const, rows, labels = [], [], []
        for label, kind, where, pending, running in self._points:
            row = np.zeros(len(self.blocks) * nm)
            if kind == "opt":
                v = self._at(where, m, b)
                before = where[:1] - 1
                if offload_optimizer:      # parameters and gradients only (Note 5)
                    v = self._at(before, m, b) - self._opt[before]
                elif self._opt_rise is not None:                      # Note 7
                    v = self._at(before, m, b) + self._opt_rise
                const.append(float(v.max()))
                rows.append(row)
                labels.append(label)
                continue
            if kind == "seg":
                idx = where
            else:
                idx = np.array([where[1]])              # (level before, peak) of the block
            v = self._at(idx, m, b)
            if accumulate and not self.grads_on_host:   # all gradients alive, each new one a
                # temporary first (Note 5)
                v = v + (self.grads_bytes - self._grads[idx]) + self._new_grads[idx]
            if offload_optimizer:
                v = v - self._opt[idx]
            const.append(float(v.max()))
            for u in pending:
                k = self._units[u][0]
                for j, mode in enumerate(MODES):
                    row[k * nm + j] -= self.unit_saved_bytes(u, mode, m)
            if kind == "bw":
                k = self._units[running][0]
                for j, mode in enumerate(MODES):
                    row[k * nm + j] += self._extra_bw(running, mode, m)
            rows.append(row)
            labels.append(label)
        return Rows(np.array(const), np.array(rows), labels)

    def with_optimizer_step(self, est) -> "MemoryModel":
        """This model with the optimizer step of ``est``, a plain trace of the same step with
        another optimizer implementation (Note 7)."""
        return self.with_optimizer_rise(optimizer_rise_bytes(est))

    def with_optimizer_rise(self, rise: float) -> "MemoryModel":
        """This model with an optimizer step that rises ``rise`` bytes above the level it
        starts from (Note 7; a rise of 0 bounds an implementation not traced yet)."""
        out = copy.copy(self)
        out._opt_rise = rise
        return out

    def with_optimizer_state(self, est) -> "MemoryModel":
        """This model with the optimizer state and step of ``est``, a plain trace of the same
        step with a low-bit optimizer state (Note 9)."""
        start = est.phases.get("optimizer", len(est.timeline))
        return self.with_state_bytes(level_before(est, start, "optimizer"),
                                     optimizer_rise_bytes(est))

    def with_state_bytes(self, state: float, rise: float) -> "MemoryModel":
        """This model with ``state`` bytes of optimizer state (made before the step, alive
        throughout) instead of its own, and an optimizer step that rises ``rise`` above where
        it starts (Note 9)."""
        return self._with_state(state - self.optimizer_state_bytes, rise)

    def with_optimizer_of(self, plain: "MemoryModel", variant: "MemoryModel") -> "MemoryModel":
        """This model with the optimizer of ``variant``, a model of ``plain``'s step with another
        implementation or state (Notes 7 and 9), for a step whose forward and backward are
        this model's: every point shifts by the state ``variant`` holds beyond ``plain``'s,
        and the optimizer step rises as ``variant``'s does."""
        return self._with_state(variant.optimizer_state_bytes - plain.optimizer_state_bytes,
                                variant._opt_rise)

    def _with_state(self, shift: float, rise: float) -> "MemoryModel":
        """This model with ``shift`` more bytes of optimizer state at every point and an
        optimizer step that rises by ``rise``."""
        out = copy.copy(self)
        out._fixed, out._opt, out._total = self._fixed + shift, self._opt + shift, \
            self._total + shift
        out.optimizer_state_bytes = self.optimizer_state_bytes + shift
        out._opt_rise = rise
        return out

    def peak_phase(self) -> str:
        """Where the traced plain step peaks: "forward/backward" or "optimizer"."""
        return "optimizer" if int(np.argmax(self._total)) >= self.opt_start else "forward/backward"

    def _at(self, idx, m: int, b: int) -> np.ndarray:
        return self._fixed[idx] + self._act[idx] * m + self._inp[idx] * b

    def device_bytes(self, allocated: float) -> int:
        """Device bytes (Note 6) for ``allocated`` bytes at the peak."""
        return round(allocated * self.device_ratio) + self.context_bytes


class _Fit:
    """Lines through two batch sizes (Note 2): ``(fixed, per sample)``."""

    def __init__(self, b: int, half: int | None):
        self.b, self.half = b, half

    def line(self, at_b: np.ndarray, at_half: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slope = (at_b - at_half) / (self.b - self.half)
        return at_b - slope * self.b, slope

    def pair(self, at_b: float, at_half: float | None) -> tuple[float, float]:
        if self.half is None or at_half is None:
            return 0.0, at_b / self.b
        slope = (at_b - at_half) / (self.b - self.half)
        return at_b - slope * self.b, slope


def _at(pair: tuple[float, float], m: int) -> float:
    return pair[0] + pair[1] * m


def _sum(cats: dict, names) -> np.ndarray:
    return np.sum([np.asarray(cats[c], dtype=np.float64) for c in names], axis=0)


def _selective_kept(est, r, fw_span, saved: int) -> int:
    """Inputs plus what the matmul-like ops allocated in one forward pass (Note 3)."""
    a, e = fw_span
    made = sum(c[3] for c, op in zip(est.op_costs[a:e + 1], est.op_log[a:e + 1])
               if is_saved_op(op))
    return min(r.input_bytes + made, saved)
