"""The user's own step (``step=fn``) in estimate, plan and fit: what it fixes, how it is traced.

Note 1 (what the step fixes). ``fn(model, batch, optimizer)`` is the user's training step as written
(``memfit.step.UserStep`` calls it, rewriting nothing): its precision (autocast, a GradScaler), its
micro-batches, its clipping and where it calls ``zero_grad`` are its own, so the knobs that would
change them (``precision`` other than "fp32", which means "nothing added", ``micro_batch_size``
other than the whole batch, ``max_grad_norm``, ``zero_grad``, ``remat``, ``optimizer_in_backward``:
the step calls ``optimizer.step()`` itself) are refused with the fix,
and a ``loss_fn`` has nothing to do. What memfit can still apply reaches the step through the model
and the optimizer it is handed: per-block ``checkpoint`` / ``offload`` (block hooks),
``offload_optimizer`` and ``optimizer_impl`` (the optimizer is rebuilt, and ``fn`` gets that one).

Note 2 (steady state). The step is traced twice on the same fakes and the second call is
counted (``trace.profile.profile_step(two_steps=True)``): the first call creates the optimizer
state and whatever ``fn`` keeps between calls, and leaves whatever it leaves (gradients when its
``zero_grad`` comes after the forward or keeps the buffers, an EMA copy, the loss it returns),
so the counted call starts from what a real step >= 2 starts from. A ``scheduler`` factory is
built on the fake optimizer and stepped after each call, as ``Runner.step`` does. One call is
one whole optimizer step (accumulate micro-batches inside it): a step that steps the optimizer
only every k-th call would be counted at a call that does not.

Note 3 (the batch). The step receives the batch as given: an all-ones attention mask is kept
(``fn`` may read it), unlike memfit's own step (``memfit.step.prepare_batch``). transformers
skips building the 4-D mask for an all-ones one on real tensors, and so does the trace: it
reads the mask's real values where the real step does (``trace.known_values``).

Note 4 (what cannot be traced). ``fn`` runs on fake tensors: a real tensor it captured from
outside (the real model, an EMA copy made beforehand, a scheduler over the real optimizer)
cannot meet them, and a value read back (``loss.item()``, ``float(loss)``, printing a tensor)
does not exist. Both are refused with the fix: build such state from the arguments, return the
loss instead of reading it. A read that happens in code the step calls (an optimizer's step, a
library's loss) is not the step's: the trace's own error names the line that reads
(``trace.profile.read_site``), and the step is not blamed. Reads the trace can answer (step
counts, random draws, scalar summaries of the weights, the batch's integers) never get here
(``trace.data_dependent``).
"""

from __future__ import annotations

from memfit.errors import TraceError
from memfit.knobs import Knobs
from memfit.step import UserStep
from memfit.trace.profile import read_site

__all__ = ["check_step_knobs", "as_user_step", "with_backward_phase", "explain_step_error",
           "step_notes", "check_cuda_autocast", "STEP_FIXED_NOTE"]

STEP_FIXED_NOTE = ("step=fn: precision, micro-batch size, clipping and zero_grad placement are "
                   "the step's own; memfit applies only per-block recompute / offload (block "
                   "hooks) and the optimizer's placement and implementation")


def as_user_step(step) -> UserStep | None:
    """``step`` as a ``UserStep`` (None stays None); a non-callable is refused."""
    if step is None or isinstance(step, UserStep):
        return step
    return UserStep(step)


def check_step_knobs(k: Knobs, batch_size: int, loss_fn=None) -> Knobs:
    """Refuse what a user step fixes itself (Note 1); returns the knobs with those left unset
    (``precision="fp32"`` and a ``micro_batch_size`` of the whole batch mean the same)."""
    if loss_fn is not None:
        raise ValueError("loss_fn with step=fn: the step computes its own loss; leave loss_fn out")
    if k.precision not in (None, "fp32"):
        raise ValueError(f"precision={k.precision!r} with step=fn: the step's precision is its "
                         "own (use torch.autocast and a GradScaler inside it); leave precision "
                         "unset")
    if k.micro_batch_size not in (None, batch_size):
        raise ValueError(f"micro_batch_size={k.micro_batch_size} with step=fn: the step runs the "
                         f"batch it is given ({batch_size} samples); split it inside the step, "
                         "or leave micro_batch_size unset")
    for name, why in (("max_grad_norm", "clip inside the step (torch.nn.utils.clip_grad_norm_)"),
                      ("zero_grad", "the step's own zero_grad call decides"),
                      ("remat", "DTR is not applied to a user step yet"),
                      ("optimizer_in_backward", "the step calls optimizer.step() itself; to "
                       "step in backward, register the per-parameter hooks in it (torchtune's "
                       "register_optim_in_bwd_hooks)")):
        if getattr(k, name) not in (None, False):
            raise ValueError(f"{name}={getattr(k, name)!r} with step=fn: {why}; leave {name} "
                             "unset")
    return k.replace(precision=None, micro_batch_size=None)


def step_notes(step: UserStep, batch) -> list[str]:
    """What an estimate of a user step says about itself (Note 3)."""
    return [f"traced the user's step {step.name} (steady state: its second call counted)"]


def with_backward_phase(phases: dict[str, int], modules) -> dict[str, int]:
    """The traced phases with "backward" added: the first op of any module's backward (a user
    step does not say when its backward starts); ordered by op index."""
    out = dict(phases)
    starts = [r.bw_span[0] for r in modules.values() if r.bw_span is not None]
    if starts and "backward" not in out:
        out["backward"] = min(starts)
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def check_cuda_autocast(step: UserStep, device_name: str) -> None:
    """Refuse a GPU estimate of a step whose ``torch.autocast("cuda")`` this machine turned off
    (a CPU-only build warns and runs the region uncast): its trace counted an fp32 step, not the
    one the GPU runs."""
    if step.cuda_autocast_off:
        raise ValueError(
            f"step {step.name} enters torch.autocast('cuda'), which this PyTorch turns off "
            f"(no CUDA here), so a trace for the {device_name} would count an fp32 step where "
            "the GPU runs a 16-bit one. Estimate it where CUDA is available, or let memfit "
            "run the step: leave step=fn out and pass precision='bf16' or 'fp16' (with "
            "zero_grad=... and max_grad_norm=... for the loop style), which models CUDA's "
            "autocast on this machine")


_REAL_TENSOR = "Please convert all Tensors to FakeTensors"


def explain_step_error(e: BaseException, step: UserStep) -> BaseException | None:
    """A clear error for what a user step cannot do on fakes (Note 4), or None to re-raise."""
    if _REAL_TENSOR in str(e):
        return ValueError(
            f"step {step.name} used a real tensor it did not receive (the real model, an "
            "optimizer or scheduler built over it, an EMA copy or any tensor captured from "
            "outside): memfit traces the step on fake copies of the model, batch and optimizer "
            "it passes in. Build such state from those arguments, e.g. ema = "
            "EMAS.setdefault(model, copy) with EMAS a weakref.WeakKeyDictionary, and pass a "
            f"scheduler as scheduler=lambda opt: ... ({type(e).__name__}: {e})")
    if isinstance(e, TraceError) and e.op is not None and "_local_scalar_dense" in e.op:
        if not _read_in_step(e, step):
            return None            # the trace's message names the library line that reads
        return TraceError(
            f"step {step.name} reads a value back (loss.item(), float(loss), a tensor in an "
            "if or a print): a trace has shapes, not values. Return the loss from the step "
            "and read it outside (memfit.fit's runner.step returns it as a float); a "
            "GradScaler's own inf check is modelled, other reads are not. "
            f"Traced error: {e}", op=e.op, module=e.module)
    return None


def _read_in_step(e: TraceError, step: UserStep) -> bool:
    """Whether the value read back was read in the file of the user's step (Note 4), not in
    library code it called; True when the site is unknown."""
    site = read_site(e.__cause__ or e)
    code = getattr(step.fn, "__code__", None)
    return site is None or code is None or site.filename == code.co_filename
