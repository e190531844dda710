"""A ``torch.compile``d model, traced as the compiler runs it (trace.compiled, issue 30).

The oracle is a real compiled CPU step in a fresh process, measured by PyTorch's profiler from
the CPU allocator's own events (tests/trace/_compiled_oracle.py): memfit's estimate of the same
step is held to it within 1%. The default tier runs one model; ``--runslow`` runs gpt2, llama
and ViT, compiled whole and per block, with the partitioner's default and budgets 0.5 and 0.0.
The other tests need no C++ compiler: they check what is found, refused and left untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import memfit
from memfit import zoo
from memfit.api._blockwise import blocks_or_why
from memfit.api._traced import trace_step
from memfit.errors import TraceError
from memfit.knobs import Knobs
from memfit.trace import FakeCopier
from memfit.trace._counted_compile import compiled_trace
from memfit.trace.compiled import compiled_regions, eager_view, wrap_regions
from memfit.units import format_bytes
from tests.trace._compiled_oracle import (DEFAULT_ROW, ROWS, build, estimated,
                                          measured_in_fresh_process)


def _check(job: dict) -> None:
    est, real = estimated(job), measured_in_fresh_process(job)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)
    assert any(n.startswith("compiled:") for n in est.notes)


def test_compiled_gpt2_estimate_is_the_compiled_step():
    _check(DEFAULT_ROW)


@pytest.mark.slow
@pytest.mark.parametrize("job", [j for j in ROWS if j != DEFAULT_ROW],
                         ids=lambda j: "-".join(str(v) for v in j.values()))
def test_compiled_estimate_is_the_compiled_step(job):
    _check(job)


def _sum(model, x):
    return model(x).sum()


def _mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16),
                         nn.Sequential(nn.Linear(16, 16), nn.ReLU()))


def test_what_the_compile_leaves_alive_is_the_first_steps_cache():
    """trace._compile_garbage: the compile's garbage holds the compiled call's objects, so the
    counted step carries the first step's KV cache from its start: every layer's keys and
    values (2 layers x K, V of 2 x 2 heads x 16 tokens x 16 fp32 = 4,096 B each), beside a
    128-byte (1, 16) int64 the call read either way; the note says it and the fix."""
    held, notes = {}, {}
    for use_cache in (True, False):
        _, model, batch = build({"model": "llama-1b", "batch": 2, "seq_len": 16,
                                 "use_cache": use_cache})
        for block in model.model.layers:
            block.compile(backend="eager")
        t = trace_step(model, batch, "adamw", "cpu", None, Knobs(), FakeCopier("cpu"))
        held[use_cache] = t.garbage_bytes
        notes[use_cache] = memfit.estimate(memfit.Job(model, batch)).notes
    cfg = model.config
    kv = 2 * cfg.num_key_value_heads * 16 * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert held == {True: cfg.num_hidden_layers * 2 * kv + 128, False: 128}
    for use_cache in (True, False):
        assert any("compile's garbage" in n for n in notes[use_cache])
        assert any("use_cache = False" in n for n in notes[use_cache]) == use_cache


def test_regions_are_found_as_compiled():
    whole = torch.compile(_mlp(), fullgraph=True)
    (r,) = compiled_regions(whole)
    assert (r.name, r.backend_name, r.fullgraph, r.in_place) == ("", "inductor", True, False)
    m = _mlp()
    m[0].compile(backend="aot_eager")
    m[3] = torch.compile(m[3], backend="eager")
    found = {r.name: (r.backend_name, r.in_place) for r in compiled_regions(m)}
    assert found == {"0": ("aot_eager", True), "3": ("eager", False)}


class _Block(nn.Module):          # a user's block (Dynamo skips torch.nn's own frames)
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return nn.functional.gelu(self.lin(x))


def test_alike_regions_share_compiled_code_as_a_real_run_does():
    """Dynamo keeps compiled code per code object, guarded, not per torch.compile call
    (trace.compiled Note 4). In a real run of three blocks compiled one by one, block 0
    compiles (its input needs no gradient), block 1 recompiles (its input does) and block 2
    runs block 1's code: two graphs. The trace compiles the same two, and one for a region
    compiled with another backend."""
    from torch._dynamo.utils import counters

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(*(_Block() for _ in range(3)), nn.Linear(8, 8))
        for block in m[:3]:
            block.compile(backend="aot_eager")
        return m

    before = counters["stats"]["unique_graphs"]
    model()(torch.randn(2, 8)).sum().backward()
    real = counters["stats"]["unique_graphs"] - before

    m = model()
    m[3] = torch.compile(m[3], backend="eager")
    regions = compiled_regions(m)
    compiled: list[str] = []
    wrapped = wrap_regions(copy.deepcopy(eager_view(m, regions)), regions, compiled)
    with compiled_trace():
        wrapped(torch.randn(2, 8)).sum().backward()
    assert real == 2
    assert compiled == ["0", "0", "3"]


def test_the_eager_view_leaves_the_user_model_compiled():
    m = _mlp()
    m[0].compile()
    m[3] = torch.compile(m[3])
    view = eager_view(m, compiled_regions(m))
    assert compiled_regions(view) == []
    assert m[0]._compiled_call_impl is not None and type(m[3]).__name__ == "OptimizedModule"
    assert view[0].weight is m[0].weight and view[3][0].weight is m[3]._orig_mod[0].weight


def test_a_backend_memfit_does_not_model_is_refused():
    def my_backend(gm, inputs):
        return gm.forward
    model = torch.compile(_mlp(), backend=my_backend)
    with pytest.raises(ValueError, match="backend 'my_backend'.*does not model"):
        memfit.estimate(memfit.Job(model, torch.randn(4, 16), loss_fn=_sum))


def test_per_block_modes_on_a_compiled_model_are_refused():
    model = torch.compile(_mlp(), backend="aot_eager")
    with pytest.raises(ValueError, match="checkpoint.*compiled model.*activation_memory_budget"):
        memfit.estimate(memfit.Job(model, torch.randn(4, 16), loss_fn=_sum), checkpoint="all")


def test_aot_eager_saves_what_the_partitioner_keeps():
    """Without Inductor the compiled graphs run op by op: the trace is the real step's, and it
    differs from the eager step's (the partitioner recomputes the cheap activations)."""
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    eager = memfit.estimate(memfit.Job(_mlp(), x, loss_fn=_sum))
    compiled = memfit.estimate(memfit.Job(torch.compile(_mlp(), backend="aot_eager"), x,
                                          loss_fn=_sum))
    assert compiled.peak_bytes != eager.peak_bytes


def test_a_compiled_model_with_a_quantized_base_is_refused_before_any_trace():
    """bitsandbytes' 4-bit layers inside a compiled model: refused at once, by name (the
    trace failed in Dynamo after minutes)."""
    pytest.importorskip("bitsandbytes")
    from memfit.techniques.quantized_base import QuantizedBase

    model = _mlp()
    model[0].requires_grad_(False)
    QuantizedBase(QuantizedBase.Config(kind="nf4")).apply(model)
    with pytest.raises(ValueError, match="a quantized base .* with a compiled model"):
        memfit.estimate(memfit.Job(torch.compile(model, backend="aot_eager"),
                                   torch.randn(4, 16), loss_fn=_sum))


def test_a_compiled_model_is_traced_whole_not_composed():
    model = zoo.get("gpt2").build(tiny=True, device="meta")
    assert blocks_or_why(torch.compile(model, backend="eager"), Knobs()) == \
        "a compiled model is traced whole"


def test_a_graph_dynamo_never_compiles_is_an_error_not_an_eager_figure():
    model = torch.compile(_mlp(), backend="eager")
    with torch._dynamo.config.patch(disable=True), pytest.raises(TraceError, match="eagerly"):
        memfit.estimate(memfit.Job(model, torch.randn(4, 16), loss_fn=_sum))


def test_a_graph_dynamo_cannot_trace_is_said_as_such():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            y = self.lin(x)
            print("a graph break")          # fullgraph=True refuses it
            return y
    model = torch.compile(Breaks(), backend="eager", fullgraph=True)
    with pytest.raises(TraceError, match="torch.compile could not trace"):
        memfit.estimate(memfit.Job(model, torch.randn(4, 16), loss_fn=_sum))


def test_the_note_names_a_run_of_compiled_blocks_once():
    m = nn.Sequential(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)))
    for i in (0, 2):
        m[0][i].compile(backend="eager")
    notes = memfit.estimate(memfit.Job(m, torch.randn(4, 16), loss_fn=_sum)).notes
    (note,) = [n for n in notes if n.startswith("compiled:")]
    assert "compiled: 0.0 .. 2 (2 blocks) (eager);" in note and "use_cache" not in note


def _tiny_gpt2_compiled():
    _, model, batch = build({"model": "gpt2", "batch": 2, "seq_len": 32, "use_cache": False})
    return torch.compile(model, backend="aot_eager_decomp_partition"), batch


def test_activation_memory_budget_is_a_knob_set_where_pytorch_reads_it():
    """The knob compiles the regions under the budget: the same step as the global config set
    by hand, another step than the default (aot_eager_decomp_partition: the min-cut
    partitioner, run op by op, no C++)."""
    import torch._functorch.config as functorch_config

    model, batch = _tiny_gpt2_compiled()
    default = memfit.estimate(memfit.Job(model, batch)).peak_bytes
    knob = memfit.estimate(memfit.Job(model, batch), activation_memory_budget=0.5).peak_bytes
    with functorch_config.patch(activation_memory_budget=0.5):
        by_hand = memfit.estimate(memfit.Job(model, batch)).peak_bytes
    assert knob == by_hand != default


def test_activation_memory_budget_is_refused_for_an_eager_model_and_out_of_range():
    with pytest.raises(ValueError, match="torch.compile's lever"):
        memfit.estimate(memfit.Job(_mlp(), torch.randn(4, 16), loss_fn=_sum),
                        activation_memory_budget=0.5)
    for bad in (1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="activation_memory_budget must be"):
            Knobs(activation_memory_budget=bad)


@pytest.mark.slow          # a plan that fails, then plans again (about a minute)
def test_the_plan_of_a_compiled_model_lowers_the_budget_when_nothing_else_fits():
    """docs/compiled.md, the plan: with micro-batches and the optimizer's placement fixed, a
    budget under the default partition's peak is met by planning again at the largest of
    ``COMPILE_BUDGETS`` whose step fits (each estimated here); the verified peak is under it."""
    from memfit.api._plan_levers import COMPILE_BUDGETS

    model, batch = _tiny_gpt2_compiled()
    fixed = dict(precision="fp32", micro_batch_size=2, offload_optimizer=False)
    default = memfit.estimate(memfit.Job(model, batch), **fixed).peak_bytes
    peaks = {v: memfit.estimate(memfit.Job(model, batch), activation_memory_budget=v,
                                **fixed).peak_bytes for v in COMPILE_BUDGETS}
    half = peaks[0.5]
    assert half < default
    budget = (half + default) // 2
    largest = next(v for v in COMPILE_BUDGETS if peaks[v] <= budget)
    p = memfit.plan(memfit.Job(model, batch), budget=budget, **fixed)
    assert p.knobs.activation_memory_budget == largest
    assert p.predicted_peak_bytes <= budget
    assert p.reasons[0].startswith(f"activation_memory_budget={largest}")


@pytest.mark.slow          # three plans of a compiled model, each a few traces (a few minutes)
def test_the_plan_weighs_the_budget_against_a_plan_that_slows_the_step():
    """api/plan.py Note 3: tiny llama, each block compiled, at a budget the default partition
    meets only with micro-batches (or the optimizer on the host). The budgets' plans are
    weighed by predicted step time: the answer is predicted faster than the default
    partition's own plan (the budget fixed at torch's default, 1.0: nothing weighed), takes a
    budget and says so first, with both step times; its verified peak is under the budget."""
    from memfit.api._plan_levers import COMPILE_BUDGETS
    from memfit.api.plan import plan_traced
    from memfit.trace.compiled import compile_model

    _, model, batch = build({"model": "llama-1b", "batch": 4, "seq_len": 128,
                             "use_cache": False})
    model = compile_model(model, "blocks")
    job = memfit.Job(model, batch)
    default = memfit.estimate(job).peak_bytes
    least = memfit.estimate(job, activation_memory_budget=0.0).peak_bytes
    assert least < default
    budget = (least + default) // 2
    alone = plan_traced(model, batch, budget, activation_memory_budget=1.0)
    assert alone.plan.knobs.micro_batch_size < 4 or alone.plan.knobs.offload_optimizer
    weighed = plan_traced(model, batch, budget)
    assert weighed.plan.knobs.activation_memory_budget in COMPILE_BUDGETS
    assert weighed.step_s < alone.step_s
    assert weighed.plan.reasons[0].startswith("activation_memory_budget=")
    assert "predicted faster than the fastest plan at its default partition" in \
        weighed.plan.reasons[0]
    assert weighed.plan.predicted_peak_bytes <= budget


def test_compiled_code_memfit_does_not_compile_is_said_to_run_eagerly():
    """A torch.compile'd function inside the loss is not a region of the model: Dynamo runs it
    eagerly under the trace's modes, and the estimate names it instead of passing its eager
    figure off silently; the same loss uncompiled has no such note."""
    act = torch.compile(lambda x: nn.functional.gelu(x) * 2)

    def compiled_loss(model, batch):
        return act(model(batch[0])).sub(batch[1]).square().mean()

    def plain_loss(model, batch):
        return (nn.functional.gelu(model(batch[0])) * 2).sub(batch[1]).square().mean()

    model, batch = _mlp(), (torch.randn(8, 16), torch.randn(8, 16))
    said = memfit.estimate(memfit.Job(model, batch, loss_fn=compiled_loss))
    assert [n for n in said.notes if "ran eagerly in the trace" in n and "<lambda>" in n]
    quiet = memfit.estimate(memfit.Job(model, batch, loss_fn=plain_loss))
    assert not [n for n in quiet.notes if "ran eagerly" in n]


def test_cuda_graphs_are_found_however_torch_records_them_and_bounded():
    """torch keeps ``mode="reduce-overhead"`` as the option ``triton.cudagraphs``, not as a
    mode, so the note that the pool is not modelled never showed; it now does, with an upper
    bound: every byte the counted step allocates, and what was alive at its start that is not
    a parameter, gradient or optimizer state (the graphs' inputs they may copy)."""
    for mode in ("reduce-overhead", "max-autotune"):
        (region,) = compiled_regions(torch.compile(_mlp(), mode=mode))
        assert region.cuda_graphs
    assert not compiled_regions(torch.compile(_mlp()))[0].cuda_graphs
    x = torch.randn(4, 16)
    est = memfit.estimate(memfit.Job(torch.compile(_mlp(), mode="reduce-overhead"), x,
                                     loss_fn=_sum))
    bound = sum(c[3] for c in est.op_costs) + est.start_breakdown["inputs"] + \
        est.start_breakdown["other"]
    assert bound >= est.peak_bytes - sum(est.start_breakdown.values()) > 0   # what it adds
    (note,) = [n for n in est.notes if "CUDA graphs" in n]
    assert format_bytes(bound) in note
    plain = memfit.estimate(memfit.Job(torch.compile(_mlp()), x, loss_fn=_sum))
    assert not any("CUDA graphs" in n for n in plain.notes)
