"""docs/cli.md copies each command's ``--help`` (at 80 columns): the copies are the parser's
own words, so a flag added or changed is in the reference (the plan's copy once lacked
``gptq`` and ``--no-cache``)."""

import re
from pathlib import Path

import pytest

from memfit.cli import main

DOC = Path(__file__).parents[2] / "docs" / "cli.md"
SECTIONS = re.findall(r"### `(memfit[^`]*)`\n\n```text\n(.*?)```", DOC.read_text(), re.S)


def test_every_command_has_its_section():
    from memfit.cli import _COMMANDS

    documented = {command for command, _ in SECTIONS}
    assert {f"memfit {name}" for name in _COMMANDS} <= documented


@pytest.mark.parametrize("command, copied", SECTIONS, ids=[c for c, _ in SECTIONS])
def test_the_reference_is_the_help_text(command, copied, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*command.split()[1:], "--help"]) == 0
    assert capsys.readouterr().out == copied, (
        f"docs/cli.md's copy of `{command} --help` is out of date: paste `COLUMNS=80 "
        f"{command} --help` into its section")
