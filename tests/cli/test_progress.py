"""Progress off a terminal (cli._progress Note 1): rich's status draws nothing into a pipe, so
the stage is a line on stderr once the work has taken QUIET_S, and stdout stays the answer."""

import time

from rich.console import Console

from memfit.cli import _progress


def _piped() -> Console:
    console = Console(stderr=True, force_terminal=False)
    assert not console.is_terminal
    return console


def test_quick_work_prints_nothing(capsys):
    with _progress.status(_piped(), "building the model...") as s:
        s.update("tracing the plain step...")
    assert capsys.readouterr() == ("", "")


def test_slow_work_prints_each_stage_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "QUIET_S", 0.0)
    with _progress.status(_piped(), "building the model...") as s:
        s.update("tracing the plain step (fp32, batch 4)...")
        s.update("tracing the plain step (fp32, batch 4)...")      # the same stage: once
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2
    assert lines[0].startswith("memfit: [") and lines[0].endswith("s] building the model")
    assert lines[1].endswith("s] tracing the plain step (fp32, batch 4)")


def test_a_long_stage_is_printed_again(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "QUIET_S", 0.0)
    monkeypatch.setattr(_progress, "REPEAT_S", 0.5)
    with _progress.status(_piped(), "tracing...") as s:
        time.sleep(1.6)                         # the thread ticks each second
        s.update("done")
    err = capsys.readouterr().err
    assert err.count("] tracing") >= 2 and err.count("] done") == 1


def test_numbered_stages_carry_their_place_and_an_eta(capsys, monkeypatch):
    """api._stages numbers the stages; the line says which of how many, and from the second
    on, about how long is left (cli._progress Note 2)."""
    from memfit.api._stages import Stages
    monkeypatch.setattr(_progress, "QUIET_S", 0.0)
    with _progress.status(_piped(), "building the model...") as s:
        say = Stages(s.update)
        say.expect(3)
        say("tracing the plain step (fp32, batch 4)")
        time.sleep(0.3)
        say("searching")
        say("verifying: re-tracing fp32")
        say("searching again (attempt 2)")          # one more than expected
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].endswith("tracing the plain step (fp32, batch 4) (stage 1 of 3)")
    assert "searching (stage 2 of 3, about " in lines[2] and lines[2].endswith(" s left)")
    left = float(lines[2].split("about ")[1].split(" s")[0])
    assert 0.3 <= left <= 1.5          # 0.3 s a stage so far, two stages left
    assert "(stage 4 of 4, about " in lines[4]


def test_a_stage_of_the_fronts_own_has_no_place(capsys, monkeypatch):
    from memfit.api._stages import Stages
    monkeypatch.setattr(_progress, "QUIET_S", 0.0)
    with _progress.status(_piped(), "building the model...") as s:
        Stages(s.update)("tracing the plain step")
        s.update("what if: tracing smaller sequence, hidden size and depth...")
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].endswith("tracing the plain step (stage 1)")
    assert lines[2].endswith("what if: tracing smaller sequence, hidden size and depth")
