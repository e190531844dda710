"""A ``torch.compile``d model traced as the compiler runs it (issue 30; docs/compiled.md).

Note 1 (regions). A compiled region is a module wrapped by ``torch.compile(module)`` (an
``OptimizedModule``: the whole model, or each block as torchtitan does) or one compiled in place
by ``module.compile()``. ``compiled_regions`` finds them, with the backend and the options each
was compiled with; ``eager_view`` is the user's model with every wrapper taken off (shallow
copies of the modules on the path, sharing the weights: the user's model is not touched), which
the fake copier copies; ``wrap_regions`` compiles each region of the fake copy again, with the
same backend and options, as an ``OptimizedModule`` (a region compiled in place becomes a
wrapper around it: its own hooks ran inside the compiled code either way), recompiles isolated
from the user's own (``isolate_recompiles``). ``dynamic=None`` (the default: static shapes
until a shape changes) is compiled static, as a step of fixed shapes compiles: the trace's
warm-up and micro-batches must not turn it into a symbolic graph the real run never makes.
A function compiled inside the step, not a module (an optimizer's step, torchao's update of
each parameter), is compiled the same way (``trace._counted_compile``).

Note 2 (what runs). Each region's graphs are compiled into code whose buffers the trace
counts, with the counting modes following the compiled code: ``trace._counted_compile`` says
how (Dynamo, AOTAutograd's partition, Inductor's generated module with dispatching allocations
and no-op kernels).

Note 3 (what is modelled). The backends ``inductor`` (the default), ``eager``, ``aot_eager``
and ``aot_eager_decomp_partition`` run as described; any other backend is refused by name.
Inductor generates the code for the traced device: the CPU's (C++) code for every trace, so for
a GPU target the buffers are those Inductor plans for CPU code (its CUDA code fuses by other
rules), which ``compiled_note`` says. CUDA graphs (``mode="reduce-overhead"``, kept by torch
as the option ``triton.cudagraphs``) keep a private pool memfit does not model, also said, with
an upper bound (``graph_pool_bound``). What the first step's compile leaves alive (its garbage
holds the objects of the call it compiled, a transformers KV cache among them, until Python's
next full collection) is counted and said (``trace._compile_garbage``). Compiled code memfit
does not compile itself (a
``torch.compile``d function in a loss or a user's step) runs eagerly under the trace's modes;
``trace._counted_compile.eager_compiled_calls`` finds it and the estimate says so.

Note 4 (compiled code shared by alike regions). Dynamo keeps compiled code per Python code
object, guarded on what the graph read, not per ``torch.compile`` call: blocks of one list,
each compiled by its own ``block.compile()``, run the same ``forward``, so the second and later
blocks pass the first one's guards and run its code; the partition is made once, under the
``activation_memory_budget`` in force when the first block compiled (measured on a real tiny
llama, two blocks: 0.0 set around the first block's call and 1.0 around the second's gives the
step of 0.0 for both, to the byte). The trace does the same: one Dynamo context per group of
regions compiled alike (backend, options, ``fullgraph``, ``dynamic``), isolated from the
user's own compiled code (``isolate_recompiles``), so each graph is compiled once, not once a
block (docs/compiled.md, "One graph for alike blocks", has the figures).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from memfit.measure._compile_aware import is_compiled_in_place, is_compiled_wrapper
from memfit.measure._modules import find_blocks
from memfit.trace._coded_weights import holds_coded_weights
from memfit.trace._counted_compile import counted_backend
from memfit.units import format_bytes

__all__ = ["Region", "compiled_regions", "eager_view", "wrap_regions", "compiled_note",
           "graph_pool_bound", "compile_failure", "refuse_with_compiled", "compile_model",
           "check_budget", "optimizer_step_region", "COMPILE_WAYS", "MODELLED_BACKENDS",
           "CPU_CODE_NOTE"]

MODELLED_BACKENDS = ("inductor", "eager", "aot_eager", "aot_eager_decomp_partition")
# said of an Inductor-compiled piece of a GPU target's step (Note 3)
CPU_CODE_NOTE = ("Inductor's buffers are those it plans for CPU code; its CUDA code fuses by "
                 "other rules, so a GPU figure is a model of that")
COMPILE_WAYS = ("model", "blocks")


def compile_model(model: nn.Module, how: str) -> nn.Module:
    """The model compiled as a user compiles it (``memfit estimate --compile``): ``"model"``,
    ``torch.compile(model)``; ``"blocks"``, each repeated block compiled in place
    (``block.compile()``, as torchtitan compiles each transformer block), the rest eager."""
    if how == "model":
        return torch.compile(model)
    if how != "blocks":
        raise ValueError(f"compile must be one of {', '.join(COMPILE_WAYS)}, got {how!r}")
    names = find_blocks(model)
    if not names:
        raise ValueError(f"{type(model).__name__} has no list of repeated blocks to compile one "
                         f"by one: compile the whole model (--compile model)")
    for name in names:
        model.get_submodule(name).compile()
    return model


@dataclass(frozen=True)
class Region:
    """One compiled region of the model (Note 1)."""

    name: str                # qualified module name, "" for the model itself
    backend: object          # what torch.compile was given, resolved (Note 3)
    backend_name: str
    fullgraph: bool
    dynamic: bool | None
    mode: str | None         # inductor's mode, None for the default
    options: tuple           # inductor's options, as sorted (key, value) pairs
    in_place: bool           # module.compile(), not a wrapper

    @property
    def cuda_graphs(self) -> bool:
        """Whether its code runs as CUDA graphs: ``mode="reduce-overhead"`` (or
        "max-autotune"), which torch keeps as the option ``triton.cudagraphs``, not as a mode."""
        return bool(self.mode and ("reduce-overhead" in self.mode or
                                   self.mode == "max-autotune")) or \
            ("triton.cudagraphs", "True") in self.options

    def describe(self) -> str:
        where = self.name or "the model"
        extra = [f"mode={self.mode}"] if self.mode else []
        extra += ["fullgraph"] if self.fullgraph else []
        extra += [f"dynamic={self.dynamic}"] if self.dynamic is not None else []
        return f"{where} ({self.backend_name}{', ' + ', '.join(extra) if extra else ''})"


def _context_of(compiled) -> object | None:
    """The Dynamo context (``_TorchDynamoContext``) behind a compiled callable."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is not None:
        return ctx
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if hasattr(value, "callback") and hasattr(value, "fullgraph"):
            return value
    return None


def _backend_of(ctx) -> object:
    """The backend torch.compile was given: the context's callback, unwrapped."""
    backend = ctx.callback
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    return backend


def _backend_name(backend) -> str:
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        return "inductor"
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return str(name or type(backend).__name__)


def _region(name: str, compiled, in_place: bool) -> Region:
    ctx = _context_of(compiled)
    if ctx is None:
        raise ValueError(f"memfit cannot read how {name or 'the model'} was compiled (no "
                         f"torch.compile context found); compile it with torch.compile(module) "
                         f"or module.compile()")
    backend = _backend_of(ctx)
    config = getattr(backend, "config", {}) or {}
    mode = getattr(backend, "mode", None) if type(backend).__name__ == \
        "_TorchCompileInductorWrapper" else None
    options = tuple(sorted((str(k), repr(v)) for k, v in config.items()))
    return Region(name=name, backend=backend, backend_name=_backend_name(backend),
                  fullgraph=bool(getattr(ctx, "fullgraph", False)),
                  dynamic=getattr(ctx, "_dynamic", None), mode=mode, options=options,
                  in_place=in_place)


def compiled_regions(model: nn.Module) -> list[Region]:
    """The model's compiled regions, outermost first; a region inside another is left out
    (the outer one's compiler traces through it). Raises ``ValueError`` for a backend memfit
    does not model (Note 3)."""
    out: list[Region] = []
    for name, m in model.named_modules():
        if any(name == r.name or r.name == "" or name.startswith(r.name + ".") for r in out):
            continue
        if is_compiled_wrapper(m):
            out.append(_region(name, m, in_place=False))
        elif is_compiled_in_place(m):
            out.append(_region(name, m._compiled_call_impl, in_place=True))
    _check_backends(out)
    return out


def _check_backends(regions: list[Region]) -> None:
    for r in regions:
        if r.backend_name not in MODELLED_BACKENDS:
            raise ValueError(f"{r.describe()} is compiled with the backend "
                             f"{r.backend_name!r}, which memfit does not model: it models "
                             f"{', '.join(MODELLED_BACKENDS)}; estimate it uncompiled "
                             f"or compiled with one of those")


def check_budget(knobs, regions: list[Region]) -> None:
    """``activation_memory_budget`` is torch.compile's lever: refused for an eager model."""
    if knobs.activation_memory_budget is not None and not regions:
        raise ValueError(f"activation_memory_budget={knobs.activation_memory_budget} is "
                         f"torch.compile's lever (its partitioner's): the model has no compiled "
                         f"region; compile it (torch.compile(model), or block.compile() per "
                         f"block), or use checkpoint= for an eager model")


_BLOCK_KNOBS = ("checkpoint", "offload", "offload_params")     # hooks on blocks, per block
_OTHER_KNOBS = ("remat", "chunked_loss", "quantize_base")


def refuse_with_compiled(knobs, layout, regions: list[Region], model=None) -> None:
    """A ``ValueError`` for what memfit does not model of a compiled job yet (Note 3): per-block
    modes inside a compiled region (the compiler traces through their hooks; torch.compile's own
    lever is ``torch._functorch.config.activation_memory_budget``), DTR, the loss in pieces, a
    quantized base (the knob, or ``model``'s weights held in integer codes: bitsandbytes'),
    several GPUs."""
    asked = [name for name in _BLOCK_KNOBS if getattr(knobs, name) not in (None, "none")]
    asked += [name for name in _OTHER_KNOBS if getattr(knobs, name) not in (None, "none", 0,
                                                                             False)]
    if model is not None and "quantize_base" not in asked and \
            holds_coded_weights(model):
        asked.append("a quantized base (weights held in integer codes)")
    if layout is not None:
        asked.append("gpus/sharding")
    if asked:
        raise ValueError(f"{', '.join(asked)} with a compiled model ({regions[0].describe()}) "
                         f"is not modelled: memfit traces a compiled step with its precision, "
                         f"micro-batches and optimizer knobs; for less activation memory use "
                         f"torch.compile's own lever, the knob activation_memory_budget "
                         f"(memfit estimate --activation-memory-budget X), or estimate the "
                         f"model uncompiled")


def _shallow(m: nn.Module) -> nn.Module:
    c = copy.copy(m)
    c.__dict__["_modules"] = dict(m._modules)
    return c


def eager_view(model: nn.Module, regions: list[Region]) -> nn.Module:
    """The model without its compile wrappers (Note 1); the user's model is not touched."""
    root = model
    for r in regions:
        if r.name == "":
            root = model._orig_mod if not r.in_place else _shallow(model)
            if r.in_place:
                root._compiled_call_impl = None
            continue
        parts = r.name.split(".")
        parent = root = _shallow(root) if root is model else root
        for p in parts[:-1]:
            child = _shallow(parent._modules[p])
            parent._modules[p] = child
            parent = child
        child = parent._modules[parts[-1]]
        if r.in_place:
            child = _shallow(child)
            child._compiled_call_impl = None
        else:
            child = child._orig_mod
        parent._modules[parts[-1]] = child
    return root


def wrap_regions(fake: nn.Module, regions: list[Region], compiled: list[str],
                 budget: float | None = None) -> nn.Module:
    """Each region of the fake copy (``eager_view``'s structure) compiled again as the user
    compiled it (Note 1), under ``budget`` (``activation_memory_budget``, None: as torch has
    it). Regions compiled alike share one Dynamo context, so they share compiled code as in a
    real run (Note 4); ``compiled`` hears, as each graph compiles, the name of the first
    region of its group."""
    groups: list[tuple[Region, list[Region]]] = []     # backends compare equal, do not hash
    for r in regions:
        alike = dataclasses.replace(r, name="", in_place=False)
        group = next((g for a, g in groups if a == alike), None)
        if group is None:
            groups.append((alike, [r]))
        else:
            group.append(r)
    for _, group in groups:
        first = group[0]
        if len(group) == 1:          # nothing to share: compiled as the user compiled it
            ctx = lambda m, r=first: torch.compile(  # noqa: E731
                m, backend=counted_backend(r, compiled, budget), fullgraph=r.fullgraph,
                dynamic=bool(r.dynamic), isolate_recompiles=True)
        else:
            ctx = torch._dynamo.optimize(backend=counted_backend(first, compiled, budget),
                                         nopython=first.fullgraph,
                                         dynamic=bool(first.dynamic), isolate_recompiles=True)
        for r in group:
            if r.name == "":
                fake = ctx(fake)
                continue
            parent_name, _, last = r.name.rpartition(".")
            parent = fake.get_submodule(parent_name) if parent_name else fake
            parent._modules[last] = ctx(parent._modules[last])
    return fake


def optimizer_step_region(step) -> Region:
    """How an optimizer's compiled ``step`` (``opt.step = torch.compile(opt.step)``) was
    compiled; a ``ValueError`` for a backend memfit does not model (Note 3)."""
    r = _region("optimizer.step", step, in_place=False)
    _check_backends([r])
    return r


def _listed(regions: list[Region]) -> str:
    """The regions in words, a run of blocks of one list compiled alike as one item."""
    groups: dict[tuple, list[int]] = {}
    singles: list[str] = []
    for r in regions:
        head, _, last = r.name.rpartition(".")
        if head and last.isdigit():
            alike = dataclasses.replace(r, name="")
            groups.setdefault((head, alike.describe()), []).append(int(last))
        else:
            singles.append(r.describe())
    for (head, how), idx in groups.items():
        how = how.removeprefix("the model ")
        singles.append(f"{head}.{idx[0]} {how}" if len(idx) == 1 else
                       f"{head}.{min(idx)} .. {max(idx)} ({len(idx)} blocks) {how}")
    return ", ".join(singles)


def compile_failure(error: Exception, regions: list[Region]) -> str:
    """The words of a trace that Dynamo, AOTAutograd or the backend stopped
    (trace._counted_compile)."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = ", ".join(r.describe() for r in regions)
    return (f"torch.compile could not trace the compiled step ({where}): "
            f"{type(error).__name__}: {first}. memfit compiles each region as the "
            f"user did, on fake tensors; run the compiled model once on a small real batch to "
            f"see whether it compiles, or estimate the model uncompiled")


def graph_pool_bound(op_costs, start_breakdown: dict[str, int]) -> int:
    """The most a CUDA graph tree's private pool can hold over a step (Note 3): its memory
    is allocated while the graphs run, so at most every byte the step allocates (``op_costs``,
    ``measure._counting``'s, the allocations last), plus the copies it makes of the graphs'
    inputs from outside them (the batch, the module buffers: at most what was alive at the
    step's start that is not a parameter, a gradient or optimizer state)."""
    outside = start_breakdown.get("inputs", 0) + start_breakdown.get("other", 0)
    return sum(c[3] for c in op_costs) + outside


def compiled_note(regions: list[Region], device_kind: str, garbage_bytes: int = 0,
                  cache_on: bool = False, graph_pool_bound: int = 0) -> str | None:
    """What the estimate of a compiled job says about how it was modelled (Note 3);
    ``garbage_bytes``: what the compile's garbage held through the step (Note 3), of which the
    model's KV cache where ``cache_on``; ``graph_pool_bound``: the most a CUDA graph pool can
    add (``graph_pool_bound``)."""
    if not regions:
        return None
    words = [f"compiled: {_listed(regions)}; traced through Dynamo "
             f"and AOTAutograd (what forward saves is the partitioner's), each graph's buffers "
             f"as the backend's generated code allocates them"]
    if device_kind == "cuda" and any(r.backend_name == "inductor" for r in regions):
        words.append(CPU_CODE_NOTE)
    if garbage_bytes:
        words.append(f"{format_bytes(garbage_bytes)} of the first step stay alive, held by the "
                     "compile's garbage until Python's next full collection: counted, as a "
                     "run's first steps hold them" + (
                         " (the model's KV cache: training needs none, set "
                         "model.config.use_cache = False)" if cache_on else ""))
    if any(r.cuda_graphs for r in regions):
        words.append("CUDA graphs (mode reduce-overhead) keep a private memory pool across "
                     "steps that memfit does not model: the card may hold up to "
                     f"{format_bytes(graph_pool_bound)} more (an upper bound: every byte the "
                     "step allocates, and the inputs the graphs copy, held at once)")
    return "; ".join(words)
