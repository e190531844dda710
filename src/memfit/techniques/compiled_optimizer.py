"""``optimizer_impl="compiled"``: the torch optimizer's step under ``torch.compile``.

Note 1 (what runs). PyTorch's recipe for a compiled optimizer step is
``opt.step = torch.compile(opt.step)``: Dynamo traces the step (its foreach or for-loop code,
``_init_group`` included) into one graph and Inductor fuses each parameter's update into kernels
that write the state and the parameter in place, so the step holds none of the eager
implementations' parameter-sized temporaries (docs/compiled.md). memfit does the same:
``compile_step`` replaces the optimizer's ``step`` with its compiled form, in a real run with
``torch.compile`` and in a trace (fake parameters) with the counted backend of
``trace._counted_compile`` (Inductor's code for the CPU, its buffers counted, its kernels no-ops), with
the backend, ``fullgraph`` and ``dynamic`` the user compiled theirs with, if they did. A user's
own optimizer whose step is compiled that way is read as ``optimizer_impl="compiled"``
(``optimizers.impl_of``).

Note 2 (the state, eagerly). Dynamo runs ``_init_group`` while it compiles, with every dispatch
mode off: state made there would be made outside the trace (torch's step counters as real
tensors). So a trace's warm-up makes the state with the eager step (``first_step_state``, which
``trace.profile.warm_up_optimizer`` calls) and the compiled step finds it made, as the real
run's second step does. Two small differences remain, both in torch's step counters: on a GPU,
Dynamo makes the step ``capturable`` and puts each parameter's counter on the device (4 bytes,
a 512-byte block of the caching allocator each), where the eager warm-up keeps them on the
host; and where the optimizer is wrapped (bf16-pure's fp32 masters), the wrapper's warm-up
steps the compiled step, whose counters are then made outside the trace (4 bytes a parameter,
not counted).

Note 3 (what is refused). The optimizer's step on the host (``offload_optimizer``,
``offload_params``, ``offload_gradients``), per parameter in backward
(``optimizer_in_backward``), a low-bit state (bitsandbytes' kernels; torchao compiles its own
step, ``_torchao_user``), several GPUs and DTR are not modelled with it: ``Knobs`` refuses
them with the fix.
"""

from __future__ import annotations

import types

import torch
from torch._subclasses.fake_tensor import is_fake

from memfit.optimizers import OptimizerRecipe, compiled_step
from memfit.trace._counted_compile import compiled_trace, counted_compile
from memfit.trace.compiled import CPU_CODE_NOTE, optimizer_step_region

__all__ = ["CompiledStepRecipe", "compile_step", "user_region", "step_note"]


class CompiledStepRecipe(OptimizerRecipe):
    """``recipe``'s optimizer with its step compiled (Note 1); ``region``: how the user
    compiled theirs (``trace.compiled.Region``), None for torch.compile's defaults."""

    def __init__(self, recipe: OptimizerRecipe, region=None):
        super().__init__(recipe.spec, recipe.impl)
        self.inner, self.region = recipe, region

    def optimizer_class(self, params):
        return self.inner.optimizer_class(params)

    def build(self, params, origin):
        opt = self.inner.build(params, origin)
        if compiled_step(opt) is None:          # the user's own, over its own parameters, is
            compile_step(opt, self.region)      # compiled already
        return opt


def compile_step(optimizer: torch.optim.Optimizer, region=None) -> None:
    """``optimizer.step`` compiled (Note 1), with its eager step kept for the state (Note 2)."""
    eager = types.MethodType(type(optimizer).step, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if any(is_fake(p) for p in params):
        fn = counted_compile(type(optimizer).step, region)

        def step(*args, **kwargs):
            with compiled_trace():
                return fn(optimizer, *args, **kwargs)
        step._torchdynamo_orig_callable = eager      # read as compiled (optimizers.compiled_step)
    else:
        step = torch.compile(eager) if region is None else torch.compile(
            eager, backend=region.backend, fullgraph=region.fullgraph, dynamic=region.dynamic)
    optimizer.step = step
    optimizer.first_step_state = eager


def user_region(optimizer):
    """How the user compiled their optimizer's step (a ``Region``), or None (not compiled)."""
    step = compiled_step(optimizer)
    return None if step is None else optimizer_step_region(step)


def step_note(optimizer, device_kind: str) -> str | None:
    """The estimate's note for a compiled torch optimizer step (None for any other)."""
    inner = getattr(optimizer, "inner", optimizer)
    if compiled_step(inner) is None or not hasattr(inner, "first_step_state"):
        return None
    words = [f"optimizer step compiled ({type(inner).__name__}, optimizer_impl='compiled'): "
             f"traced through Dynamo and Inductor, its buffers as the generated code allocates "
             f"them"]
    if device_kind == "cuda":
        words.append(CPU_CODE_NOTE)
    return "; ".join(words)
