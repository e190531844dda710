"""bitsandbytes' 8-bit Adam as memfit builds and steps it: the classes of
``optimizer_state="8bit"`` (``low_bit_optimizer`` builds them) and a user's own bitsandbytes
optimizer, rebuilt over other parameters with everything that decides its state.

Note 1 (the step: what runs where). ``update_step`` calls the custom op
``bitsandbytes::optimizer_update_8bit_blockwise`` (``optimizer_update_32bit`` below 4096
values) once per parameter. On CUDA its kernel is fused: it reads the codes, dequantizes,
updates and requantizes in registers and writes ``p``, the codes and the absmax in place,
allocating nothing (``backends/cuda/ops.py`` passes raw pointers to ``cadam_8bit_blockwise_*``).
bitsandbytes registers a fake implementation that allocates nothing too, so a trace for a CUDA
target (``use_cuda_kernel``, called by ``trace.cuda``) counts exactly that. On CPU the
registered kernel is Python (``backends/cpu/ops.py``): it dequantizes both moments to fp32,
makes an fp32 gradient and the denominator (and, briefly, its ``sqrt``), updates ``p`` in
place and requantizes (each ``quantize_blockwise`` a uint8 copy and the absmax): per 8-bit
parameter of N values, 20 N bytes at its peak, freed before the next. Behind the op those
temporaries are invisible to a dispatch mode (``memfit.track``, the fake trace) but not to the
allocator, so on CPU tensors the op is redirected (``measure._bnb_kernels.CpuKernels``
around ``update_step``; ``track`` enters it over a real run too) to that same registered CPU
function, called as Python: the same ops, the same numbers (a test holds it bitwise to
``bnb.optim.AdamW8bit``), every temporary one the counter sees. Either way, it is bitsandbytes'
own ``step`` that runs.

Note 2 (a user's own bitsandbytes optimizer, the HF Trainer's ``adamw_bnb_8bit``). A trace
rebuilds the optimizer over fake parameters; a bitsandbytes optimizer keeps what decides its
state outside ``defaults``: ``args`` (``optim_bits``, ``min_8bit_size``, ``max_unorm``,
``skip_zeros``; transformers builds ``bnb.optim.AdamW(optim_bits=8)``), ``is_paged``, and
per-parameter overrides in its process-wide ``GlobalOptimManager`` keyed by the parameter's
``id`` (transformers registers ``optim_bits=32`` for every ``nn.Embedding`` weight, applied by
``check_overrides`` at the first step). Rebuilt from ``defaults`` alone it kept fp32 moments for
every parameter. ``rebuild_bnb`` builds the same class with the ``BnbStep`` mixin (Note 1: the
CPU kernel's temporaries counted, ``use_cuda_kernel`` for a CUDA target), the same ``args`` and
``is_paged``, and each parameter's overrides resolved now against the original's parameters
(what its own ``get_config`` would read after ``check_overrides``), kept on the instance.
Every optimizer memfit builds (rebuilt or the ``optimizer_state="8bit"`` lever) holds an empty
manager of its own instead of the process-wide one: that one keys overrides by ``id`` and by
*position* ``(group, index)`` and is never cleared, so after a Trainer with ``adamw_bnb_8bit``
any later optimizer's first parameter took fp32 moments (the lever's state then disagreed with
``low_bit_optimizer.state_bytes``), and a fake's ``id`` written there could be inherited by a later tensor.

Note 3 (paged optimizers: ``PagedAdamW``, ``PagedAdamW8bit``, ``PagedLion8bit``, ...). On a GPU,
bitsandbytes' ``get_state_buffer`` allocates the moments of a parameter of at least 100,000
values with ``cudaMallocManaged`` (``F.get_paged``), outside PyTorch's caching allocator; the
smaller ones, and the 8-bit absmax, are ordinary device tensors. On CPU tensors it warns and
falls back to ordinary buffers, which is what a CPU run holds. For a GPU target the trace's
buffers are fake CPU tensors, so the override below makes them without that warning and keeps
the paged ones in ``paged_state``: the trace counts them in unified memory, on the card beside
the allocator (``trace.cuda.CudaModel.unified_tensors``; docs/measurement.md, "Paged optimizer
state").

Note 4 (importing it). bitsandbytes' default backend wraps four of its kernels in
``torch.compile`` as it is imported (``backends/default/ops.py``, ``_try_torch_compile``);
the first ``torch.compile`` of a process imports Inductor, 0.7 s of CPU, a sixth of the
8-bit lever's trace in the README's plan, for kernels that a trace never runs (a fake tensor
runs their fake implementations) and a CPU step runs only where bitsandbytes has no kernel
of its own. So while it is imported, ``torch.compile(fn, **kw)`` returns a function that
compiles ``fn`` with the same arguments when it is first called, and calls that ever after:
what bitsandbytes' wrapper runs is unchanged (its fallback to ``fn`` on a compile error now
meets that error at the first call, which is where it met errors of compiling anyway).
"""

from __future__ import annotations

import contextlib

import functools
import importlib.util
import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

from memfit.measure._bnb_kernels import CpuKernels
from memfit.optimizers import OptimizerRecipe, rebuild_optimizer
from memfit.trace.per_parameter import once_per_kind

_PAGED_MIN_NUMEL = 100_000     # bitsandbytes' get_state_buffer pages tensors of 1e5 values or more

__all__ = ["BnbStep", "BnbRecipe", "bnb_classes", "bnb_modules", "import_bitsandbytes", "is_bnb",
           "may_make_bnb", "rebuild_bnb"]


def import_bitsandbytes():
    """``import bitsandbytes``, quietly: on a CPU with AVX-512 bf16 its CPU backend tries to
    fetch a 4-bit matmul kernel from the Hugging Face hub as it is imported, and logs a warning
    when it cannot (offline, untrusted); memfit runs none of its 4-bit matmuls on the CPU's
    fast path, so that warning says nothing to a memfit user. Its compiled kernels are
    wrapped as they are first called, not as it is imported (Note 4)."""
    import logging

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with _compile_on_first_call():
            import bitsandbytes
            import bitsandbytes.backends.cpu.ops  # noqa: F401  (the import that warns)
    finally:
        log.setLevel(level)
    return bitsandbytes


@contextlib.contextmanager
def _compile_on_first_call():
    """``torch.compile(fn, **kw)`` made lazy while bitsandbytes is imported (Note 4)."""
    real = torch.compile

    def lazy(model=None, **kwargs):
        if model is None:                                  # used as @torch.compile(...)
            return lambda fn: lazy(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **kwargs)
            return compiled(*args, **kw)
        return call

    torch.compile = lazy
    try:
        yield
    finally:
        torch.compile = real


def bnb_modules():
    """bitsandbytes' optim package and its registered CPU kernels (Note 1); a ``ValueError``
    with the fix where bitsandbytes is missing or older than 0.50."""
    try:
        import_bitsandbytes()
        import bitsandbytes.optim as bnb_optim
        from bitsandbytes.backends.cpu import ops as cpu_ops
    except ImportError as e:
        raise ValueError("optimizer_state='8bit' needs bitsandbytes (>= 0.50), which is not "
                         "installed: pip install bitsandbytes, or leave optimizer_state unset "
                         "(fp32)") from e
    if not hasattr(cpu_ops, "_optimizer_update_8bit_blockwise_cpu"):
        raise ValueError("optimizer_state='8bit' needs bitsandbytes >= 0.50 (its CPU optimizer "
                         "kernels): pip install -U bitsandbytes")
    return bnb_optim, cpu_ops


@functools.cache
def bnb_classes() -> dict[tuple[str, bool], type]:
    """("8bit", is_adamw) -> bitsandbytes' 8-bit Adam with memfit's CPU redirect (Note 1)."""
    bnb_optim, _ = bnb_modules()
    return {("8bit", adamw): type(f"Bnb{base.__name__}", (BnbStep, base), {"is_adamw": adamw})
            for adamw, base in ((True, bnb_optim.AdamW8bit), (False, bnb_optim.Adam8bit))}


@functools.cache
def _bnb_qmaps() -> tuple[list[float], list[float]]:
    """bitsandbytes' signed and unsigned dynamic maps, built once, outside every mode (its
    ``create_dynamic_map`` reads values with ``tolist``, which a fake cannot)."""
    from bitsandbytes import functional as F

    with _disable_current_modes():
        return tuple(F.create_dynamic_map(signed=s).tolist() for s in (True, False))


class BnbStep:
    """bitsandbytes' 8-bit Adam step (Note 1); mixed in before its class."""

    state_name = "8bit"
    cuda_kernel = False     # True: model the fused CUDA kernel on fake CPU tensors (trace.cuda)

    def fill_qmap(self) -> None:
        """bitsandbytes' ``fill_qmap``, its maps made in the current mode (fake in a trace)."""
        signed, unsigned = _bnb_qmaps()
        self.name2qmap["dynamic"] = torch.tensor(signed, dtype=torch.float32)
        self.name2qmap["udynamic"] = torch.tensor(unsigned, dtype=torch.float32)

    overrides: dict = {}    # (group, index) -> a parameter's config overrides (Note 2)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mng = _own_manager()       # Note 2: never the process-wide one

    def get_config(self, gindex, pindex, group):
        config = super().get_config(gindex, pindex, group)
        config.update(self.overrides.get((gindex, pindex), {}))
        return config

    def use_cuda_kernel(self) -> None:
        """Step as on a GPU: the op itself, whose fused kernel (and fake) allocates nothing."""
        self.cuda_kernel = True
        self.paged_state = []

    def get_state_buffer(self, p, dtype=torch.float32):
        """bitsandbytes' state buffer; for a GPU target, a paged optimizer's buffer of a
        parameter of at least 100,000 values is kept in ``paged_state``: on the card it is
        unified memory, outside the caching allocator (Note 3)."""
        if not self.cuda_kernel:
            return super().get_state_buffer(p, dtype)
        buff = torch.zeros_like(p, dtype=dtype)
        if self.is_paged and p.numel() >= _PAGED_MIN_NUMEL:
            self.paged_state.append(buff)
        return buff

    @torch.no_grad()
    def first_step_state(self) -> None:
        """The state of each parameter with a gradient, as bitsandbytes' first ``step`` makes
        it, without the update (a trace's warm-up needs the state, not the step's ops:
        ``trace.profile.warm_up_optimizer``)."""
        if not self.initialized:
            self.check_overrides()
            self.to_gpu()
            self.initialized = True
        for gindex, group in enumerate(self.param_groups):
            for pindex, p in enumerate(group["params"]):
                if p.grad is not None and len(self.state[p]) == 0:
                    self.init_state(group, p, gindex, pindex)

    @torch.no_grad()
    @once_per_kind(lambda self, group, p, gindex, pindex: (
        p, p.grad, self.state[p], self.get_config(gindex, pindex, group), self.cuda_kernel,
        self.is_paged, self.optimizer_name))
    def update_step(self, group, p, gindex, pindex):
        """One parameter's update; in a trace of the optimizer phase, run once per kind of
        parameter (``trace.per_parameter``)."""
        if self.cuda_kernel:
            return super().update_step(group, p, gindex, pindex)
        with CpuKernels(bnb_modules()[1]):
            return super().update_step(group, p, gindex, pindex)


def _own_manager():
    """An empty ``GlobalOptimManager`` of this optimizer's own (Note 2)."""
    manager = bnb_modules()[0].GlobalOptimManager
    mng = manager.__new__(manager)          # its __init__ refuses: a singleton by design
    mng.initialize()
    return mng


def is_bnb(optimizer) -> bool:
    """A bitsandbytes optimizer (``Optimizer8bit``; bitsandbytes is not imported for this)."""
    mod = sys.modules.get("bitsandbytes.optim.optimizer")
    return mod is not None and isinstance(optimizer, mod.Optimizer8bit)


@functools.cache
def _bnb_step_class(cls: type) -> type:
    """``cls`` stepped as Note 1 says (itself when it already is)."""
    return cls if issubclass(cls, BnbStep) else type(f"Bnb{cls.__name__}", (BnbStep, cls), {})


def _bnb_overrides(optimizer) -> dict[tuple[int, int], dict]:
    """Each parameter's config overrides as ``optimizer.get_config`` reads them once
    ``check_overrides`` has run (Note 2), by (group, index)."""
    mng, modules = optimizer.mng, {}
    if not optimizer.initialized:       # its first step runs check_overrides
        for module, attr, config in mng.module_weight_config_triple:
            modules[id(getattr(module, attr))] = config
    out = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) in modules:        # check_overrides sets both to it
                config = dict(modules[id(p)])
            else:
                config = dict(mng.index2config.get((g, i), {}))
                config.update(mng.pid2config.get(id(p), {}))
            if config:
                out[g, i] = config
    return out


def rebuild_bnb(optimizer, new_of: dict[int, torch.Tensor]):
    """A bitsandbytes ``optimizer`` over ``new_of[id(p)]``: its class, hyper-parameters,
    ``args``, paging and per-parameter overrides, stepped as Note 1 says (Note 2)."""
    bnb_modules()
    new = rebuild_optimizer(optimizer, new_of, cls=_bnb_step_class(type(optimizer)))
    new.args, new.is_paged = optimizer.args, optimizer.is_paged
    new.overrides = _bnb_overrides(optimizer)
    return new


class BnbRecipe(OptimizerRecipe):
    """A user's bitsandbytes optimizer instance: the instance itself over its own parameters,
    else ``rebuild_bnb`` (Note 2). A user's factory (``lambda ps: bnb.optim.AdamW8bit(ps)``)
    is called with every mode set aside (its constructor reads its maps' values, which a fake
    cannot) and what it made, if bitsandbytes', rebuilt the same way."""

    def _made(self, params):
        with _disable_current_modes():
            return self.factory(params)

    def optimizer_class(self, params):
        return type(self._made(params)) if self.instance is None else type(self.instance)

    def build(self, params, origin):
        if self.instance is None:
            made = self._made(params)
            if self.impl is None and is_bnb(made):
                return rebuild_bnb(made, {id(p): p for p in params})
            return super().build(params, origin)
        if self.impl is not None or all(n is o for o, n in zip(origin, params)):
            return super().build(params, origin)
        return rebuild_bnb(self.instance, {id(o): n for o, n in zip(origin, params)})


def may_make_bnb(recipe: OptimizerRecipe) -> bool:
    """A user's factory, where bitsandbytes is installed: it may build one of its optimizers
    (``BnbRecipe`` finds out; bitsandbytes is not imported for this)."""
    return recipe.instance is None and not isinstance(recipe.spec, str) and \
        _bnb_installed()


@functools.cache
def _bnb_installed() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None

