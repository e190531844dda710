"""A real compiled CPU step measured by PyTorch's profiler, not by memfit (issue 30's oracle).

Run as a script in a fresh process (``python -m tests.trace._compiled_oracle '<json>'``): it
builds a zoo model (tiny config, random weights), compiles it as asked (the whole model, or
each block with ``module.compile()``), runs three steps of the plain loop (``zero_grad``,
forward, loss, backward, AdamW's ``step``) and prints, as JSON, the peak of the live CPU bytes in
the third step. A job ``{"torchao": name, ...}`` instead steps a small MLP with the user's own
torchao optimizer of that class, whose step compiles each parameter's update as torchao does
(``torchao_job``); ``{"compiled_optimizer": true, "model": ...}`` steps a torch AdamW whose
step is compiled as PyTorch's recipe does (``opt.step = torch.compile(opt.step)``) on the
model uncompiled ("mlp": that MLP, else a zoo model). The bytes are the CPU allocator's own allocation and free events
(``torch.profiler`` with ``profile_memory``), summed from the start of the process's profiled
window, in which the model, the batch and the optimizer are made: every live byte is one the
profiler saw allocated. ``estimated`` is memfit's estimate of the same job, for the
side-by-side; ``allocator_peak`` reads any profiled run's peak the same way.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import torch

_GPT2 = {"model": "gpt2", "batch": 2, "seq_len": 32}
_LLAMA = {"model": "llama-1b", "batch": 2, "seq_len": 32}
# docs/compiled.md's "Measured" rows, in its order: tests/trace/test_compiled.py holds each
# within 1%, benchmarks/compiled_measured.py prints them all
DEFAULT_ROW = {**_GPT2, "compile": "model"}          # the one the default tier runs
ROWS = [
    DEFAULT_ROW,
    {**_GPT2, "compile": "blocks"},
    {**_GPT2, "compile": "model", "activation_memory_budget": 0.5},
    {**_GPT2, "compile": "model", "activation_memory_budget": 0.5, "use_cache": False},
    {**_GPT2, "compile": "model", "activation_memory_budget": 0.0},
    {**_LLAMA, "compile": "model"},
    {**_LLAMA, "compile": "blocks", "use_cache": False},
    {**_LLAMA, "compile": "model", "activation_memory_budget": 0.0},
    {"model": "vit-base", "batch": 2, "compile": "blocks"},
    {"model": "vit-base", "batch": 2, "compile": "model"},
    {**_LLAMA, "compile": "blocks", "use_cache": True},
    {**_LLAMA, "compile": "model", "activation_memory_budget": 0.5},
    {**_LLAMA, "compile": "blocks", "activation_memory_budget": 0.5},
    {**_GPT2, "compile": "blocks", "activation_memory_budget": 0.5},
    {**_GPT2, "compile": "blocks", "activation_memory_budget": 0.0},
    {**_LLAMA, "compile": "blocks", "activation_memory_budget": 0.0},
    {"model": "vit-base", "batch": 2, "compile": "blocks", "activation_memory_budget": 0.5},
    {"model": "vit-base", "batch": 2, "compile": "model", "activation_memory_budget": 0.5},
    {"model": "vit-base", "batch": 2, "compile": "model", "activation_memory_budget": 0.0},
    {"model": "vit-base", "batch": 2, "compile": "blocks", "activation_memory_budget": 0.0},
]


def build(job: dict):
    from memfit import zoo
    spec = zoo.get(job["model"])
    torch.manual_seed(0)
    model = spec.build(tiny=True, device="cpu")
    if "use_cache" in job:
        model.config.use_cache = job["use_cache"]
    kw = {"seq_len": job["seq_len"]} if job.get("seq_len") else {}
    return spec, model, spec.make_batch(model, job["batch"], **kw)


def mlp():
    """(model, batch, loss_fn): an MLP whose weights torchao quantizes (16,384 values each)
    and whose biases it does not (256 and 64)."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model, (torch.randn(16, 64), torch.randn(16, 64)), mse_loss


def torchao_job(job: dict):
    """(model, batch, loss_fn, optimizer) of a torchao job: ``mlp`` and the user's own torchao
    optimizer ``job["torchao"]`` with ``job.get("kw")``."""
    import torchao.optim as ao

    model, batch, loss_fn = mlp()
    optimizer = getattr(ao, job["torchao"])(model.parameters(), lr=1e-3, **job.get("kw", {}))
    return model, batch, loss_fn, optimizer


def mse_loss(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def compile_as(model, how: str):
    """``how``: "model" (``torch.compile(model)``) or "blocks" (``block.compile()`` each), as
    ``memfit estimate --compile`` compiles it."""
    from memfit.trace.compiled import compile_model
    return compile_model(model, how)


def budget(job: dict):
    """The job's ``activation_memory_budget`` set where PyTorch reads it (a context)."""
    from memfit.trace._counted_compile import activation_budget
    return activation_budget(job.get("activation_memory_budget"))


def estimated(job: dict):
    """memfit's ``Estimate`` of the same job, for the side-by-side (not the oracle)."""
    import memfit
    _, model, batch = build(job)
    with budget(job):
        return memfit.estimate(memfit.Job(compile_as(model, job["compile"]), batch))


def measured_in_fresh_process(job: dict) -> int:
    """``measured_peak(job)``, run as this script in a fresh process (the oracle's own Dynamo
    and allocator state, none of the caller's)."""
    out = subprocess.run([sys.executable, "-m", "tests.trace._compiled_oracle", json.dumps(job)],
                         capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def allocator_peak(prof, window: str | None = None) -> int:
    """The peak of live CPU bytes from a ``torch.profiler`` run's allocator events (every
    allocation and free, summed in time order from the profile's start), within the
    ``record_function`` named ``window`` if given."""
    events = list(prof.profiler.kineto_results.events())
    span = next((e for e in events if e.name() == window), None) if window else None
    memory = sorted((e.start_ns(), i, e.nbytes()) for i, e in enumerate(events)
                    if e.name() == "[memory]")
    live, peak = 0, None
    for t, _, delta in memory:
        live += delta
        if span is None or span.start_ns() <= t <= span.end_ns():
            peak = live if peak is None else max(peak, live)
    return peak


def measured_peak(job: dict) -> int:
    """The job's third step's peak, Python's cycle collector off while the steps run: a
    compile leaves garbage holding what it compiled (a KV cache), which the first steps of a
    run hold until a full collection comes, and whether one came before the third step
    depended on the compile's own allocations (a warm Inductor cache made fewer); the oracle is
    the run before one (trace._compile_garbage Note 1)."""
    was = gc.isenabled()
    gc.disable()
    try:
        return _measured_peak(job)
    finally:
        if was:
            gc.enable()


def last_step_peak(make, step, steps: int = 3) -> int:
    """The peak of the last of ``steps`` real steps, from the CPU allocator's own events:
    ``make()`` builds what the steps use inside the profile (so every live byte is one the
    profiler saw allocated) and ``step(*made)`` runs one."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        made = make()
        for i in range(steps):
            with torch.profiler.record_function(f"step{i}"):
                step(*made)
    return allocator_peak(prof, f"step{steps - 1}")


def _measured_peak(job: dict) -> int:
    if "torchao" in job:
        return _torchao_peak(job)
    if job.get("compiled_optimizer"):
        return _compiled_optimizer_peak(job)

    def make():
        _, model, batch = build(job)
        return compile_as(model, job["compile"]), batch, \
            torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(run, batch, opt):
        opt.zero_grad(set_to_none=True)
        run(**batch).loss.backward()
        opt.step()

    with budget(job):
        return last_step_peak(make, step)


def optimizer_job(job: dict):
    """(model, batch, loss_fn) of a compiled-optimizer job: ``mlp`` for ``"mlp"``, else the
    zoo model (tiny config)."""
    if job["model"] == "mlp":
        return mlp()
    _, model, batch = build(job)
    return model, batch, None


def _canonical(model, batch, loss_fn, optimizer):
    from memfit.step import canonical_step

    canonical_step(model, optimizer, batch, loss_fn)


def _compiled_optimizer_peak(job: dict) -> int:
    def make():
        model, batch, loss_fn = optimizer_job(job)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        optimizer.step = torch.compile(optimizer.step)
        return model, batch, loss_fn, optimizer

    return last_step_peak(make, _canonical)


def _torchao_peak(job: dict) -> int:
    """Three steps of memfit's plain loop (``canonical_step``) with torchao's own class, its
    step compiled by torchao; the third step's peak."""
    return last_step_peak(lambda: torchao_job(job), _canonical)


if __name__ == "__main__":
    print(json.dumps({"peak": measured_peak(json.loads(sys.argv[1]))}))
