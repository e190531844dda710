"""The planner picks the allocator setting and counts its bytes (``api._plan_allocator``).

Oracle: where the chosen setting is expandable segments alone, ``trace.cuda``'s own replay of
the step under ``AllocatorConfig(expandable_segments=True)`` (a different code path from
memplan's storage-log replay) gives the reserved bytes the plan predicts. On the CPU machine a
CUDA run cannot happen: the Runner's CPU path is held bitwise to the plain one, and the refusal
of a setting the running allocator cannot take is checked with CUDA's state patched (the only
way to reach it without a GPU)."""

import copy
import dataclasses
import json

import pytest
import torch
from torch import nn

import memfit
from memfit.units import format_bytes
from memfit.api._plan_allocator import AllocatorChoice, apply_allocator
from memfit.api._setup import build_runner
from memfit.cli import main
from memfit.knobs import Knobs
from memfit.optimizers import OptimizerRecipe
from memfit.planner import Plan
from memfit.trace.allocator import AllocatorConfig

GPU = "a100-80gb"
EXPANDABLE = AllocatorConfig(expandable_segments=True)


def _mlp(width=1800, depth=3, device="meta"):
    with torch.device(device):
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU())
                               for _ in range(depth)])


def _loss(model, batch):
    return model(batch["x"]).square().mean()


@pytest.fixture(scope="module")
def mlp_case():
    """An MLP step on which expandable segments reserve ~100 MiB less (memplan's model)."""
    model = _mlp()
    batch = {"x": torch.randn(1500, 1800, device="meta")}
    run = dict(optimizer="adamw", device=GPU, loss_fn=_loss)
    plain = memfit.estimate(model, batch, **run)
    expandable = memfit.estimate(model, batch, allocator=EXPANDABLE, **run)
    assert expandable.device_bytes < plain.device_bytes      # the case is what it claims
    return model, batch, run, plain, expandable


def test_a_step_that_fits_only_under_the_best_setting_is_planned_with_it(mlp_case):
    model, batch, run, plain, expandable = mlp_case
    budget = plain.device_bytes - 1          # the plain step misses under the default
    p = memfit.plan(model, batch, budget, **run)
    assert p.allocator == {"scheme": "default", "expandable_segments": True,
                           "saved_bytes": plain.reserved_bytes - expandable.reserved_bytes}
    assert set(p.blocks.values()) == {"keep"} and p.knobs.micro_batch_size == 1500
    # the trace's own replay under expandable segments is what the plan predicts
    assert p.predicted_reserved_bytes == expandable.reserved_bytes
    assert p.predicted_device_bytes == expandable.device_bytes <= budget
    assert p.reasons[0] == "the plain step fits under the allocator setting below"
    assert any("default + expandable_segments reserves" in r and "counted in the budget" in r
               for r in p.reasons)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in p.explain()


def test_a_fixed_allocator_is_no_choice(mlp_case):
    model, batch, run, plain, expandable = mlp_case
    fixed = memfit.plan(model, batch, plain.device_bytes - 1, allocator=EXPANDABLE, **run)
    assert fixed.allocator is None            # traced as set: its bytes are the trace's
    assert fixed.predicted_reserved_bytes == expandable.reserved_bytes


@pytest.mark.slow
def test_the_default_fixed_makes_the_search_find_another_configuration(mlp_case):
    model, batch, run, plain, expandable = mlp_case
    pinned = memfit.plan(model, batch, plain.device_bytes - 1, allocator=AllocatorConfig(), **run)
    assert pinned.allocator is None           # default fixed: the plain step no longer fits
    assert pinned.predicted_device_bytes <= plain.device_bytes - 1
    assert (pinned.knobs.optimizer_impl, pinned.knobs.micro_batch_size) != (None, 1500) or \
        set(pinned.blocks.values()) != {"keep"}


def test_a_started_allocator_keeps_its_segments_and_the_reasons_say_what_it_misses(mlp_case):
    """Note 3: a model already on a GPU pins expandable_segments to the running allocator's;
    the choice's limit is set here by hand (no GPU to start one)."""
    model, batch, run, plain, expandable = mlp_case
    choice = AllocatorChoice(model, memfit.get_device(GPU), None)
    assert choice.free and choice.expandable is None          # a meta model: free
    choice.expandable = False
    assert choice.saved(plain) == 0                # no pool scheme beats the default here
    assert not choice.fits(plain, 0, plain.device_bytes - 1)
    out = choice.apply(Plan(Knobs(), predicted_device_bytes=plain.device_bytes), plain)
    assert out.allocator is None and out.predicted_device_bytes == plain.device_bytes
    assert any("expandable_segments stays False" in r and "plan again" in r for r in out.reasons)


def test_the_setting_round_trips_through_json_and_old_plans_still_load():
    p = Plan(Knobs(precision="fp32"), predicted_device_bytes=10,
             allocator={"scheme": "phase-pools", "expandable_segments": True, "saved_bytes": 4})
    back = Plan.from_json(p.to_json())
    assert back == p and dict(back.allocator)["scheme"] == "phase-pools"
    with pytest.raises(TypeError):
        p.allocator["saved_bytes"] = 0          # read-only, as the plan's other containers
    old = json.loads(p.to_json())
    del old["allocator"]                        # a plan written before the field existed
    assert Plan.from_json(json.dumps(old)).allocator is None


def test_a_cpu_target_chooses_nothing():
    model, batch = _mlp(64, 2), {"x": torch.randn(8, 64, device="meta")}
    p = memfit.plan(model, batch, optimizer="adamw", device="cpu", loss_fn=_loss)
    assert p.allocator is None


def _train(plan, seed=0, steps=2):
    torch.manual_seed(seed)
    model = _mlp(32, 2, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runner = build_runner(model, OptimizerRecipe(opt), plan.knobs, plan=plan, loss_fn=_loss)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        runner.step({"x": torch.randn(16, 32, generator=gen)})
    return runner, [p.detach().clone() for p in model.parameters()]


def test_a_plan_with_a_setting_runs_on_cpu_bitwise_as_without():
    setting = {"scheme": "phase-pools", "expandable_segments": True, "saved_bytes": 2 ** 20}
    plan = Plan(Knobs(precision="fp32", micro_batch_size=8), batch_size=16)
    with_setting, params = _train(dataclasses.replace(plan, allocator=setting))
    _, plain = _train(plan)
    assert all(torch.equal(a, b) for a, b in zip(params, plain))
    assert with_setting.on_phase is None      # no pools entered on the CPU
    assert any("phase-pools + expandable_segments: not applied, the model runs on cpu" in n
               for n in with_setting.applied.notes)


def test_a_setting_the_running_allocator_cannot_take_is_refused(monkeypatch):
    """A plan made elsewhere needs expandable segments; CUDA has started without them."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    plan = Plan(Knobs(), allocator={"scheme": "default", "expandable_segments": True,
                                    "saved_bytes": 3 * 2 ** 20})
    with pytest.raises(RuntimeError, match=r"assume default \+ expandable_segments \(3.00 MiB "
                                           r"less.*export PYTORCH_CUDA_ALLOC_CONF="
                                           r"expandable_segments:True before starting Python"):
        apply_allocator(plan, "cuda")
    model = _mlp(8, 1, device="cpu")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="cannot take expandable_segments any more"):
        build_runner(model, OptimizerRecipe(torch.optim.SGD(model.parameters(), lr=0.1)),
                     Knobs(checkpoint="all"), plan=plan, device_type="cuda", loss_fn=_loss)
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks   # untouched
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    pools, note = apply_allocator(plan, "cuda")          # already in force: nothing to refuse
    assert pools is None and "expandable_segments:True is in force" in note


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory):
    """A small GPT-2 whose 12000-token logits leave the default allocator a segment to spare."""
    from memfit import zoo

    path = tmp_path_factory.mktemp("gpt2-12k")
    cfg = zoo.get("gpt2").config(tiny=True)
    cfg.vocab_size, cfg.architectures = 12000, ["GPT2LMHeadModel"]
    cfg.save_pretrained(path)
    with torch.device("meta"):
        model = __import__("transformers").GPT2LMHeadModel(cfg)
    batch = zoo.get("gpt2").make_batch(model, 8, seq_len=128)
    plain = memfit.estimate(model, batch, optimizer="adamw", device=GPU, optimizer_impl="foreach")
    args = ["plan", "--config", str(path), "--batch-size", "8", "--seq-len", "128",
            "--gpu", GPU, "--precision", "fp32", "--optimizer-impl", "foreach",
            "--budget", str(plain.device_bytes - 1)]
    return args, plain.device_bytes


def test_cli_json_carries_the_setting(gpt2_config, capsys):
    args, plain = gpt2_config
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plain_device_bytes"] == plain            # the API's plain step, as traced
    assert out["allocator"] == out["plan"]["allocator"]
    assert out["allocator"]["expandable_segments"] and out["allocator"]["saved_bytes"] > 0
    assert out["plan"]["predicted_device_bytes"] <= plain - 1


@pytest.mark.slow
def test_cli_prints_the_setting(gpt2_config, capsys):
    args, _ = gpt2_config
    assert main(args + ["--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["plan"]["predicted_device_bytes"]
    assert main(args) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "allocator setting: default + expandable_segments" in text
    line = text.split("with the plan")[1].split("allocator setting")[0]
    # the plan's bytes, the saving taken off once (the verdict took it off the planned
    # trace again, which is already under the setting)
    assert "FITS on a budget" in line and f"needs {format_bytes(predicted)} " in line
    assert "the plain step fits under the allocator setting below" in text


def test_the_planned_trace_every_front_draws_is_the_plans_bytes(mlp_case):
    """Issue 27: the console printed the plan's device bytes (the allocator setting's saving
    taken off), the report and the plot the chosen trace's under the default allocator. The
    trace a plan carries (``Planned.chosen``) is the one under the chosen setting: its device
    bytes and card are the plan's, which the trace's own replay under expandable segments gives."""
    from memfit.api.plan import plan_traced
    from memfit.report.plots import RESERVED_LEVEL_LABEL, before_after_figure

    model, batch, run, plain, expandable = mlp_case
    planned = plan_traced(model, batch, plain.device_bytes - 1, **run)
    p, chosen = planned.plan, planned.chosen
    assert p.allocator is not None and p.allocator["saved_bytes"] > 0
    assert chosen.device_bytes == p.predicted_device_bytes == expandable.device_bytes
    assert chosen.reserved_bytes == p.predicted_reserved_bytes
    assert chosen.card.device_bytes == chosen.device_bytes
    fig = before_after_figure(planned.plain, chosen, limit_bytes=p.budget_bytes)
    level = [ln for ln in fig.axes[1].get_lines() if ln.get_label().startswith(RESERVED_LEVEL_LABEL)]
    assert level and f"{memfit.format_bytes(p.predicted_device_bytes)};" in level[0].get_label()


@pytest.mark.parametrize("name, knobs, gpu", [
    ("gpt2", dict(precision="fp16"), "gtx-1080-ti"),
    ("llama-1b", dict(precision="bf16", checkpoint="all"), GPU),
    ("bert-base", dict(precision="fp16", offload="all", optimizer_state="8bit"), "t4"),
    ("gpt2", dict(micro_batch_size=2), "gtx-1080-ti"),
])
def test_no_setting_reserves_below_the_allocated_peak_and_the_default_is_the_traces(
        name, knobs, gpu):
    """Note 6's premises, on steps of several kinds; the bound they give skips the replays."""
    from memfit import zoo
    from memfit.memplan import allocator_options

    spec = zoo.get(name)
    model = spec.build(tiny=True, device="meta")
    est = memfit.estimate(model, spec.make_batch(model, 4), device=gpu, **knobs)
    opts = allocator_options(est, ("default", "optimizer-pool", "phase-pools"))
    assert opts.default.reserved_bytes == est.reserved_bytes
    assert all(o.allocated_bytes == est.peak_bytes <= o.reserved_bytes for o in opts.options)
    assert est.reserved_bytes > est.peak_bytes          # a case where a setting could save
    choice = AllocatorChoice(model, memfit.get_device(gpu), None)
    most = est.reserved_bytes - est.peak_bytes
    assert not choice.fits(est, 0, est.device_bytes - most - 1)
    assert choice._options == {}                        # refused without a replay
    choice.fits(est, 0, est.device_bytes - most)
    assert id(est) in choice._options                   # within reach: replayed
