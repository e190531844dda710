"""``memfit.estimate``: the memory of one steady-state training step, without running it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from memfit.api._setup import build_runner, resolve_device, resolve_precision
from memfit.api._validate import check_batch, describe_batch_mismatch
from memfit.devices import DeviceSpec
from memfit.errors import TraceError
from memfit.knobs import Knobs
from memfit.measure import ModuleRecord
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.trace import FakeCopier, profile_step
from memfit.trace.scaler import TraceGradScaler
from memfit.units import parse_bytes

__all__ = ["Estimate", "estimate"]


@dataclass
class Estimate:
    """A predicted step. Bytes are device bytes; ``peak_bytes`` is the allocated peak."""

    peak_bytes: int
    reserved_bytes: int                # allocator reservation at the peak (== peak on CPU)
    breakdown: dict[str, int]          # category -> bytes at the peak
    timeline: list[int]                # live bytes after each op of the step
    op_log: list[str]                  # the aten op behind each timeline point
    timeline_by_category: dict[str, list[int]]
    phases: dict[str, int]             # "forward"/"backward"/"optimizer" -> first op index
    modules: dict[str, ModuleRecord]   # per module, in execution order
    blocks: list[str]                  # the repeated layers, in execution order
    fw_flops: int
    bw_flops: int
    device: DeviceSpec
    limit_bytes: int                   # what ``fits`` compares with: budget, else usable memory
    knobs: Knobs
    trace_seconds: float
    basis: str = "cpu-trace"           # how the figures were obtained
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.reserved_bytes <= self.limit_bytes

    @property
    def headroom_bytes(self) -> int:
        """Bytes left under the limit (negative: how much is missing)."""
        return self.limit_bytes - self.reserved_bytes

    @property
    def validated(self) -> bool:
        """True when the figures are exact for the target (a CPU trace for a CPU target)."""
        return self.device.kind == "cpu"

    def to_dict(self) -> dict:
        return {
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "breakdown": dict(self.breakdown),
            "fits": self.fits,
            "limit_bytes": self.limit_bytes,
            "headroom_bytes": self.headroom_bytes,
            "device": self.device.name,
            "precision": self.knobs.precision,
            "micro_batch_size": self.knobs.micro_batch_size,
            "fw_flops": self.fw_flops,
            "bw_flops": self.bw_flops,
            "basis": self.basis,
            "validated": self.validated,
            "notes": list(self.notes),
            "trace_seconds": round(self.trace_seconds, 3),
            "blocks": [
                {"name": n, "saved_bytes": self.modules[n].saved_bytes,
                 "input_bytes": self.modules[n].input_bytes,
                 "param_bytes": self.modules[n].param_bytes,
                 "fw_flops": self.modules[n].fw_flops}
                for n in self.blocks
            ],
        }


def estimate(model: nn.Module, batch, optimizer="adamw", device=None,
             loss_fn: Callable | None = None, *, budget=None, count_fn: Callable | None = None,
             **knobs) -> Estimate:
    """Predict the memory of one steady-state training step of ``model`` on ``batch``.

    Traces zero_grad -> forward -> loss -> backward -> optimizer.step on fake tensors (no real
    memory, no real compute); ``model`` may be real or on the ``meta`` device and is not
    touched. ``optimizer``: a name ("adamw", "sgd", ...), an instance, or a factory
    ``params -> Optimizer``. ``device``: a GPU name ("gtx-1080-ti"), "cpu" or a ``DeviceSpec``
    (default: where the model is). ``budget`` (bytes or "11GiB") replaces the device's usable
    memory as the limit ``fits`` checks. Knobs: ``precision``, ``micro_batch_size`` (the peak
    of the whole accumulated effective batch), ``max_grad_norm``; ``count_fn`` as in ``fit``.
    """
    k = Knobs.from_kwargs(**knobs)
    k.check_available()
    if k.precision == "auto":
        raise ValueError("estimate needs a fixed precision (fp32, fp16, bf16, bf16-pure); "
                         "'auto' is for memfit.plan and memfit.fit")
    spec = resolve_device(model, device)
    k = k.replace(precision=resolve_precision(k.precision, spec))
    precision = k.precision
    limit = parse_bytes(budget) if budget is not None else spec.usable_bytes
    recipe = OptimizerRecipe(optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    recipe.check_params(trainable)
    batch = prepare_batch(batch)
    check_batch(model, batch, loss_fn)
    batch_size_of(batch)

    copier = FakeCopier("cpu")
    fake_model = copier.module(model)
    fake_model.train(model.training)
    fake_batch = copier.tree(batch)
    with copier.mode:
        runner = build_runner(fake_model, recipe, k, plan=Plan(k), origin=trainable,
                              loss_fn=loss_fn, count_fn=count_fn, scaler_class=TraceGradScaler)
        fake_batch = runner.precision.prepare_batch(fake_batch)

    def run(on_phase):
        runner.run(fake_batch, on_phase)

    # steady state: optimizer state exists (and, under fp16, the scaler's scale)
    warm_up = (lambda: runner.run(fake_batch)) if runner.scaler is not None else None
    try:
        prof = profile_step(run, copier=copier, model=runner.model, optimizer=runner.optimizer,
                            warm_up=warm_up)
    except TypeError as e:
        if "argument" in str(e):
            raise ValueError(f"the batch does not match {type(model).__name__}.forward: {e}") from e
        raise
    except RuntimeError as e:
        if isinstance(e, TraceError) or "shape" not in str(e) and "size" not in str(e):
            raise
        raise describe_batch_mismatch(model, batch, e) from e
    notes = []
    if spec.kind == "cuda":
        notes.append("CPU trace: CUDA kernels, autocast rules and the caching allocator are "
                     "not modelled yet; figures are unvalidated for this GPU")
    return Estimate(
        peak_bytes=prof.peak_bytes, reserved_bytes=prof.peak_bytes, breakdown=prof.breakdown,
        timeline=prof.timeline, op_log=prof.op_log, timeline_by_category=prof.timeline_by_category,
        phases=prof.phases, modules=prof.modules, blocks=prof.blocks, fw_flops=prof.fw_flops,
        bw_flops=prof.bw_flops, device=spec, limit_bytes=limit, knobs=k,
        trace_seconds=prof.trace_seconds, notes=notes,
    )
