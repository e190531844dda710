"""transformers' own activation checkpointing, traced for a GPU target.

Note 1 (the problem). For a GPU target the step is traced under memfit's CUDA kernel models,
torch-function modes entered around the whole step (``trace.cuda``: ``CudaSdpaMode`` runs SDPA as
the GPU's kernel would, with that kernel's saved tensors). A checkpoint's recompute runs in
backward, where those modes are no longer active: the recomputed SDPA would take the CPU's path,
save other tensors than the forward did, and ``torch.utils.checkpoint`` stops with a
``CheckpointError`` (metadata mismatch). memfit's own checkpoint re-enters the models around its
recompute (its ``recompute_context``: ``CudaModel.recompute``).

Note 2 (the fix: checkpoint's ``context_fn``). transformers checkpoints each
``GradientCheckpointingLayer`` through the layer's ``_gradient_checkpointing_func`` (a partial of
``torch.utils.checkpoint.checkpoint`` with the ``activation_checkpointing_kwargs``). On the
traced (fake) model, ``model_recompute`` wraps that function so every call also passes a
``context_fn`` whose recompute context enters a fresh ``CudaSdpaMode`` of the same GPU (and the
user's own ``context_fn`` contexts, where the kwargs had one). The forward context adds nothing
(the forward already runs inside the modes). So transformers' recompute is traced as memfit's
own is, and on a CPU target nothing is wrapped (no mode is active). The user's model is never
touched: the trace runs on a fake copy. ``context_fn`` exists only for non-reentrant
checkpoint: ``use_reentrant=True`` for a GPU target is refused with the fix (``check``).
"""

from __future__ import annotations

import contextlib

from torch.overrides import _get_current_function_mode_stack

from memfit.trace.cuda_sdpa import CudaSdpaMode

__all__ = ["model_recompute", "check"]

_REENTRANT = ("gradient_checkpointing_kwargs use_reentrant=True with a GPU device: memfit traces "
              "the recompute with the GPU's kernels through torch.utils.checkpoint's context_fn, "
              "which only non-reentrant checkpoint takes. Set use_reentrant=False (transformers' "
              "default; the same recompute), or estimate for device='cpu'")


def check(kwargs: dict | None) -> None:
    """Refuse what cannot be traced for a GPU target (Note 2)."""
    if (kwargs or {}).get("use_reentrant") is True:
        raise ValueError(_REENTRANT)


def model_recompute(model) -> None:
    """Every checkpointing layer of ``model`` (the fake copy) recomputes under the CUDA models
    active now (Note 2); nothing when none is (a CPU target)."""
    modes = [m for m in _get_current_function_mode_stack() if isinstance(m, CudaSdpaMode)]
    if not modes:
        return
    sdpa = modes[-1]
    for module in model.modules():
        fn = vars(module).get("_gradient_checkpointing_func")
        if fn is None or isinstance(fn, _ModelledCheckpoint):
            continue
        check(getattr(fn, "keywords", None))
        module._gradient_checkpointing_func = _ModelledCheckpoint(fn, sdpa)


class _ModelledCheckpoint:
    """A layer's checkpoint function with the CUDA models re-entered in its recompute."""

    def __init__(self, fn, sdpa: CudaSdpaMode):
        self.fn, self.sdpa = fn, sdpa
        self.user = (getattr(fn, "keywords", None) or {}).get("context_fn")

    def __call__(self, function, *args, **kwargs):
        user = kwargs.pop("context_fn", None) or self.user
        sdpa = self.sdpa

        def context_fn():
            forward, recompute = user() if user is not None else \
                (contextlib.nullcontext(), contextlib.nullcontext())
            return forward, _together(recompute, sdpa.compute_capability, sdpa.build)
        return self.fn(function, *args, context_fn=context_fn, **kwargs)


@contextlib.contextmanager
def _together(recompute, compute_capability, build):
    with recompute, CudaSdpaMode(compute_capability, build):
        yield
