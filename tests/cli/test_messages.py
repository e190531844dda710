"""Messages a person or a program reads (issue 26 items 15 and 16): errors under --json are one
JSON object; BudgetTooSmall is lines; a suggestion names only the flags of the command that
prints it; one syntax per flag in every subcommand; every flag has help; output paths and
impossible budgets are refused before any trace."""

import argparse
import importlib
import json
import sys

import pytest
import torch

import memfit
from memfit.cli import build_parser, main
from memfit.cli._errors import to_flags


@pytest.fixture
def no_trace(monkeypatch):
    """Any trace fails the test: what is checked here must be refused before one."""
    def traced(*args, **kwargs):
        raise AssertionError("traced")
    for name in ("memfit.api._planner", "memfit.api._plan_parts", "memfit.api.estimate"):
        importlib.import_module(name)
        monkeypatch.setattr(sys.modules[name], "estimate", traced)


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_flag_of_every_subcommand_has_help():
    for name, sub in _subparsers(build_parser()).items():
        for action in sub._actions:
            if action.option_strings:
                assert action.help, f"memfit {name} {action.option_strings[0]} has no help"


def test_an_error_under_json_is_one_json_object(capsys):
    assert main(["plan", "--json", "--budget", "foo"]) == 2          # argparse's refusal
    out = json.loads(capsys.readouterr().out)
    assert out["type"] == "usage" and "--budget" in out["error"]
    assert main(["estimate", "--json", "--model", "no-such-model"]) == 2   # memfit's
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["type"] == "ValueError" and "no-such-model" in out["error"]
    assert "memfit: error:" in captured.err                              # a person's line too


def test_an_impossible_budget_is_refused_before_any_trace_in_lines(capsys, no_trace):
    """llama-3-8b on an 11 GiB card: its fp32 gradients alone (29.92 GiB) exceed the card,
    whatever memfit offloads; refused without a trace, in lines, and as JSON."""
    argv = ["plan", "--model", "llama-3-8b", "--gpu", "gtx-1080-ti"]
    assert main([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["type"] == "BudgetTooSmall" and out["floor_is_bound"]
    grads = 8_030_261_248 * 4                 # llama-3-8b's parameters, fp32 gradients
    assert out["floor_bytes"] >= grads > out["budget_bytes"]
    lines = captured.err.strip().splitlines()
    assert len(lines) >= 5 and lines[0].startswith("memfit: error: nothing memfit can do fits")
    assert any(line.startswith("  - the weights alone (29.92 GiB)") for line in lines)
    assert "--lora-rank R" in captured.err and " B:" not in captured.err   # plan has the flag


def test_a_suggestion_names_only_the_commands_flags():
    text = ("freeze parameters (requires_grad=False) or train LoRA adapters (peft); "
            "micro_batch_size=2")
    assert to_flags(text) == ("freeze parameters (--freeze PATTERN) or train LoRA adapters "
                              "(--lora-rank R); --micro-batch-size 2")
    train = {o for a in _subparsers(build_parser())["train"]._actions for o in a.option_strings}
    assert "--lora-rank" not in train
    assert to_flags(text, train) == text      # train has none of them: the API's words stay


def test_python_values_read_as_flags():
    assert to_flags("fsdp_offload=True, reshard_after_forward=False") == \
        "--fsdp-offload on, --reshard-after-forward off"
    with pytest.raises(ValueError) as info:
        memfit.estimate(torch.nn.Linear(2, 2), {"x": torch.zeros(2, 2)}, sharding="fsdp",
                        loss_fn=lambda m, b: m(b["x"]).sum())
    assert "None" not in to_flags(str(info.value))


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_one_syntax_for_a_switch_in_every_subcommand(command, capsys):
    parse = lambda *flags: build_parser().parse_args([command, *flags])     # noqa: E731
    for flag, dest in (("--offload-optimizer", "offload_optimizer"),
                       ("--fsdp-offload", "fsdp_offload")):
        assert getattr(parse(flag), dest) is True
        assert getattr(parse(flag, "on"), dest) is True
        assert getattr(parse(flag, "off"), dest) is False
        assert getattr(parse(), dest) is None
    assert parse("--reshard-after-forward", "off").reshard_after_forward is False
    assert parse("--reshard-after-forward", "4").reshard_after_forward == 4
    assert parse("--reshard-after-forward", "true").reshard_after_forward is True   # old
    assert "deprecated" in capsys.readouterr().err
    assert parse("--sharding", "none").sharding == "none"
    assert parse("--max-grad-norm", "1.5").max_grad_norm == 1.5
    assert parse("--optimizer-state", "8bit").optimizer_state == "8bit"
    assert parse("--offload-params", "all").offload_params == "all"


def test_plan_passes_its_new_knobs():
    from memfit.cli.plan import _knobs

    args = build_parser().parse_args(["plan", "--optimizer-state", "8bit", "--offload-params",
                                      "all", "--offload-optimizer"])
    k = _knobs(args)
    assert (k["optimizer_state"], k["offload_params"], k["offload_optimizer"]) == \
        ("8bit", "all", True)


def test_plan_checks_report_paths_before_tracing(capsys, no_trace, tmp_path):
    missing = tmp_path / "no-such-folder" / "r.html"
    assert main(["plan", "--model", "gpt2", "--report", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_gpus_prints_memory_and_usable_in_one_unit(capsys):
    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    assert "memory GiB" in out and "usable GiB" in out and "11.00" in out and "10.92" in out


def test_the_plan_says_your_micro_batch_size_when_you_fixed_it():
    """The reasons of a plan whose micro-batch and checkpoint the caller fixed say so, in the
    CLI as its flags (not "the largest micro-batch the fastest plan could afford")."""
    from types import SimpleNamespace

    from memfit.api._plan_words import global_reasons
    from memfit.knobs import Knobs

    choice = SimpleNamespace(precision="fp32", micro_batch_size=2, modes=("recompute", "keep"),
                             optimizer_impl=None, offload_optimizer=False, optimizer_state=None,
                             offload_params=None, chunked_loss=None,
                             optimizer_in_backward=None, offload_gradients=None,
                             mix_step_s=None)
    ctx = SimpleNamespace(user="fp32", spec=SimpleNamespace(kind="cpu"), default_impl=None,
                          impl_searched=False)
    memory = SimpleNamespace(optimizer_state_bytes=0)
    fixed = global_reasons(Knobs(micro_batch_size=2, checkpoint=("0",), offload="none"),
                           choice, memory, 4, ctx, 1.0)
    assert "micro-batch 2 x 2 accumulated: your micro_batch_size=2" in fixed
    assert "blocks: 1 recompute of 2: as your checkpoint=0 and offload=none set" in fixed
    assert "your --micro-batch-size 2" in to_flags(" ".join(fixed), bare=False)
    assert to_flags("held by the allocator", bare=False) == "held by the allocator"
    free = global_reasons(Knobs(), choice, memory, 4, ctx, 1.0)
    assert any("the largest micro-batch the fastest plan could afford" in r for r in free)


def test_a_value_in_another_fronts_position_is_named_with_the_order():
    """estimate, plan and fit order their arguments after the model differently: a value in
    another front's place is refused naming this front's order and the keyword, before any
    trace (not "cannot read 'adamw' as a size in bytes")."""
    model, batch = torch.nn.Linear(4, 1), {"x": torch.randn(2, 4)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for call, needle in ((lambda: memfit.plan(model, batch, "adamw"), "pass optimizer="),
                         (lambda: memfit.estimate(model, batch, "1GiB"), "pass budget='1GiB'"),
                         (lambda: memfit.fit(model, batch, opt), "fit(model, optimizer, batch)")):
        with pytest.raises(ValueError, match="name them by keyword") as info:
            call()
        assert needle in str(info.value)
