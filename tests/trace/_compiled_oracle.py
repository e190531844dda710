"""A real compiled CPU step measured by PyTorch's profiler, not by memfit (issue 30's oracle).

Run as a script in a fresh process (``python -m tests.trace._compiled_oracle '<json>'``): it
builds a zoo model (tiny config, random weights), compiles it as asked (the whole model, or
each block with ``module.compile()``), runs three steps of the plain loop (``zero_grad``,
forward, loss, backward, AdamW's ``step``) and prints, as JSON, the peak of the live CPU bytes in
the third step. The bytes are the CPU allocator's own allocation and free events
(``torch.profiler`` with ``profile_memory``), summed from the start of the process's profiled
window, in which the model, the batch and the optimizer are made: every live byte is one the
profiler saw allocated.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch


def build(job: dict):
    from memfit import zoo
    spec = zoo.get(job["model"])
    torch.manual_seed(0)
    model = spec.build(tiny=True, device="cpu")
    if "use_cache" in job:
        model.config.use_cache = job["use_cache"]
    kw = {"seq_len": job["seq_len"]} if job.get("seq_len") else {}
    return spec, model, spec.make_batch(model, job["batch"], **kw)


def compile_as(model, how: str):
    """``how``: "model" (``torch.compile(model)``) or "blocks" (``block.compile()`` each), as
    ``memfit estimate --compile`` compiles it."""
    from memfit.trace.compiled import compile_model
    return compile_model(model, how)


def budget(job: dict):
    value = job.get("activation_memory_budget")
    if value is None:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config
    return functorch_config.patch(activation_memory_budget=value)


def measured_peak(job: dict) -> int:
    from torch.profiler import ProfilerActivity, profile

    with budget(job), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _, model, batch = build(job)
        run = compile_as(model, job["compile"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(3):
            with torch.profiler.record_function(f"step{i}"):
                opt.zero_grad(set_to_none=True)
                run(**batch).loss.backward()
                opt.step()
    events = list(prof.profiler.kineto_results.events())
    step = next(e for e in events if e.name() == "step2")
    memory = sorted((e.start_ns(), i, e.nbytes()) for i, e in enumerate(events)
                    if e.name() == "[memory]")
    live, peak = 0, None
    for t, _, delta in memory:
        live += delta
        if step.start_ns() <= t <= step.end_ns():
            peak = live if peak is None else max(peak, live)
    return peak


if __name__ == "__main__":
    print(json.dumps({"peak": measured_peak(json.loads(sys.argv[1]))}))
