"""An estimate's arguments, checked before any trace, and a trace's exception read as the
user's mistake it reveals (``api._traced``)."""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointError

from memfit.api._user_step import as_user_step, check_step_knobs
from memfit.api._validate import check_batch, check_micro_batch, describe_batch_mismatch
from memfit.errors import TraceError
from memfit.knobs import Knobs
from memfit.step import prepare_batch
from memfit.techniques.accumulation import batch_size_of
from memfit.techniques.optimizer_in_backward import check_knobs as check_in_backward

__all__ = ["checked_step", "described"]


def described(e: Exception, model, batch, loss_fn) -> Exception:
    """A trace's exception as the user's mistake it reveals (the batch does not fit the
    model's forward), chained to it; else the exception itself."""
    if isinstance(e, TypeError) and loss_fn is None and (
            "unexpected keyword argument" in str(e) or "required positional argument" in str(e)):
        err = ValueError(f"the batch does not match {type(model).__name__}.forward: {e}")
    elif isinstance(e, RuntimeError) and not isinstance(e, (TraceError, CheckpointError)) and \
            ("shape" in str(e) or "size" in str(e)):
        err = describe_batch_mismatch(model, batch, e)
    else:
        return e
    err.__cause__ = e
    return err


def checked_step(model, batch, loss_fn, k: Knobs, step, scheduler, compiled: bool = False):
    """(the user's step or None, the knobs it leaves, the batch as the step takes it), each
    checked before any trace; ``compiled``: the model has compiled regions
    (``memfit.step.prepare_batch``)."""
    user = as_user_step(step)
    if scheduler is not None and (hasattr(scheduler, "step") or not callable(scheduler)):
        raise ValueError("estimate traces on a fake optimizer, so a scheduler built on the real "
                         "one cannot be used: pass scheduler=a factory, e.g. "
                         "lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)")
    if user is not None:
        k = check_step_knobs(k, batch_size_of(batch), loss_fn)
    if k.precision == "auto":
        raise ValueError("estimate needs a fixed precision (fp32, fp16, bf16, bf16-pure); "
                         "'auto' is for memfit.plan and memfit.fit")
    if user is None:               # a user step takes the batch as given (_user_step)
        batch = prepare_batch(batch, compiled)
        check_batch(model, batch, loss_fn)
    check_micro_batch(k.micro_batch_size, batch_size_of(batch))
    check_in_backward(k, batch_size_of(batch))      # optimizer_in_backward's refusals
    return user, k, batch
