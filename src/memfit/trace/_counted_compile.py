"""Compiling into code whose buffers a trace counts (trace.compiled; docs/compiled.md).

Note 1 (what runs). Inside ``compiled_trace()`` memfit's counting modes let Dynamo compile
under them and follow the compiled code (``measure._compile_aware``). Dynamo captures each
region's graphs, with graph breaks as it always makes them; AOTAutograd traces forward and
backward together and the min-cut partitioner picks what forward saves for backward (reading
``torch._functorch.config.activation_memory_budget`` as it does in a real run). The backend
then compiles each graph. Inductor's output is a Python module: a ``call`` that allocates its
buffers (``empty_strided_cpu``), reuses and frees them as its memory planning decided, calls
extern kernels (matmuls, with ``out=``) and generated C++ kernels, and returns the outputs and
the saved tensors. memfit loads that module with its own allocation and view functions swapped
for dispatching ones (the originals are C++ that skips every mode), and with each generated
kernel a no-op: on fake tensors a kernel writes nothing anyone reads, and its buffers are
already counted where ``call`` made them. What a kernel reads is still read: a storage no op
read before it (ViT's image batch, which only a kernel's channels_last copy reads) is counted
from the step's start, as an op's first read counts it. The C++ is never compiled. So the
trace sees exactly the buffers the generated code holds and when, the saved tensors the
partitioner kept, and the matmuls' FLOPs; the fused pointwise kernels run no op and count no
FLOPs. The backward is compiled with the forward (``force_non_lazy_backward_lowering``), while
the counting modes are off.
A function compiled inside the step, not a module (an optimizer's step, torchao's update of
each parameter), is compiled the same way: ``counted_function``, ``counted_compile``.

Note 2 (what the trace does not compile). Compiled code memfit does not compile itself (a
``torch.compile``d function in a loss or a user's step) finds memfit's modes not following
compiled code, so Dynamo runs it eagerly under them: ``eager_compiled_calls`` names it, from
Dynamo's own record of the frames it skipped, for the estimate's note.
"""

from __future__ import annotations

import contextlib
import functools
import sysconfig
from pathlib import Path
from unittest import mock

import torch
from torch.utils._pytree import tree_leaves

from memfit.measure._compile_aware import following_compiled
from memfit.measure._counting import count_first_reads
from memfit.measure.track import active_tracker

__all__ = ["activation_budget", "counted_backend", "counted_function", "counted_compile",
           "compiled_trace", "eager_compiled_calls", "eager_calls_note"]


def activation_budget(value: float | None):
    """``torch._functorch.config.activation_memory_budget`` set to ``value`` while it lasts,
    where the partitioner reads it (a context; ``None``: as it is)."""
    if value is None:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=float(value))


def counted_backend(region, compiled: list[str], budget: float | None):
    """``region``'s backend (a ``trace.compiled.Region``), compiling into code whose buffers
    the trace counts (Note 1), under ``budget`` (the knob ``activation_memory_budget``);
    ``compiled`` hears the region's name as each graph compiles."""
    def backend(gm, example_inputs):
        compiled.append(region.name)
        with _counted_inductor(), activation_budget(budget):
            return region.backend(gm, example_inputs)
    return backend


def _counted_default_backend(gm, example_inputs):
    """torch.compile's default backend (Inductor, no mode or options) compiling into counted
    code (Note 1)."""
    from torch._inductor.compile_fx import compile_fx

    with _counted_inductor():
        return compile_fx(gm, example_inputs)


@functools.cache
def counted_function(fn, fullgraph: bool = False, dynamic: bool = False):
    """``torch.compile(fn, fullgraph=..., dynamic=...)`` with the default backend, compiled into
    code whose buffers a trace counts (Note 1): a function that compiles itself inside a step
    (torchao's optimizer step) traced as it runs. One per process, so the shapes compiled for one
    trace serve the next; its recompiles are its own (a real run of ``fn`` never reuses its
    no-op kernels). Call it on fake tensors, inside ``compiled_trace()``."""
    return torch.compile(fn, backend=_counted_default_backend, fullgraph=fullgraph,
                         dynamic=dynamic, isolate_recompiles=True)


def counted_compile(fn, region=None):
    """``fn`` compiled as ``region`` (a ``trace.compiled.Region``) says: the user's backend,
    ``fullgraph``, ``dynamic``, into counted code; None: torch.compile's defaults
    (``counted_function``)."""
    if region is None:
        return counted_function(fn)
    return torch.compile(fn, backend=counted_backend(region, [], None),
                         fullgraph=region.fullgraph, dynamic=bool(region.dynamic),
                         isolate_recompiles=True)


@contextlib.contextmanager
def compiled_trace():
    """Around a trace of a compiled job: memfit's modes follow the compiled code, and Dynamo
    neither gives up on a fake copy's recompiles nor reuses a cached compile (Note 1)."""
    import torch._dynamo.config as dynamo_config

    with following_compiled(), \
            dynamo_config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16):
        yield


_EAGER_UNDER_MODES = "non-infra torch dispatch mode present"
_INSIDE = (str(Path(__file__).resolve().parents[1]), str(Path(torch.__file__).resolve().parent))
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve())


def _a_call(path: str) -> bool:
    """A skipped frame that is a compiled function the step called, not one of the frames
    Dynamo also skips while its eager code runs under the modes (memfit's, torch's, the
    standard library's)."""
    if path.startswith(_INSIDE):
        return False
    return not path.startswith(_STDLIB) or "-packages" in path


@contextlib.contextmanager
def eager_compiled_calls(found: list[str]):
    """While it lasts, each compiled function the step calls that memfit does not compile
    itself (not a region of the model, not the optimizer's step: a ``torch.compile``d function
    inside the loss or a user's step) is added to ``found``: Dynamo runs it eagerly under the
    trace's modes, so its figure is the eager one's, and the estimate says so (Note 2). Read
    from Dynamo's own record of the frames it skipped, and why (its ``dynamo_tls``; where a
    torch has none, nothing is found)."""
    from torch._dynamo import eval_frame

    tls = getattr(eval_frame, "dynamo_tls", None)
    if tls is None or not hasattr(tls, "skip_reasons"):
        yield
        return
    prior, tls.skip_reasons = tls.skip_reasons, []
    try:
        yield
    finally:
        for reason in tls.skip_reasons or []:
            where = reason.split("): ", 1)[0] + ")"
            if _EAGER_UNDER_MODES in reason and where not in found and \
                    _a_call(where.rpartition(" (")[2]):
                found.append(where)
        tls.skip_reasons = prior


def eager_calls_note(found: list[str]) -> str | None:
    """The estimate's note for what ``eager_compiled_calls`` found (None: nothing)."""
    if not found:
        return None
    return (f"the step calls compiled code memfit does not compile itself ({'; '.join(found)}): "
            f"it ran eagerly in the trace, so its part of the figure is the eager one's; memfit "
            f"traces as compiled a torch.compile'd model or blocks and an optimizer step "
            f"compiled as opt.step = torch.compile(opt.step)")


def _noop_kernel(*args, **kwargs) -> None:
    """A generated C++ kernel, not run: what it reads is still read (Note 1)."""
    tracker = active_tracker(fake=True)       # a fake ledger counts fake storages only
    if tracker is not None:
        count_first_reads(tracker, tree_leaves((args, kwargs)))


def _empty_strided(size, stride, dtype, *args, **kwargs) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    return base.as_strided(size, stride, base.storage_offset() + offset)


@contextlib.contextmanager
def _counted_inductor():
    """While a region compiles: Inductor's generated module loaded fresh, with dispatching
    allocation and views and no-op kernels, never from a cache (Note 1)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import async_compile, codecache

    def load(cls, key, path, linemap=None, attrs=None, **kwargs):
        mod = codecache._reload_python_module(key, path, set_sys_modules=False)
        for k, v in (attrs or {}).items():
            setattr(mod, k, v)
        mod.empty_strided_cpu = _empty_strided
        mod.reinterpret_tensor = _reinterpret
        return mod

    with mock.patch.object(async_compile.AsyncCompile, "cpp_pybinding",
                           lambda self, argtypes, source: _noop_kernel), \
            mock.patch.object(async_compile.AsyncCompile, "cpp",
                              lambda self, source: _noop_kernel), \
            mock.patch.object(codecache.PyCodeCache, "load_by_key_path", classmethod(load)), \
            inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False,
                                  compile_threads=1), \
            functorch_config.patch(enable_autograd_cache=False,
                                   force_non_lazy_backward_lowering=True):
        yield
