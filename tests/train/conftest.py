"""A ``memfit`` command line with the train and bench subcommands, as ``memfit.cli.main`` runs
them (cli/__init__.py registers them separately), and a small generated data set."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from memfit.cli import bench as bench_cmd
from memfit.cli import train as train_cmd
from memfit.cli._args import join_dash_values
from memfit.cli._errors import cli_warnings, format_error, is_user_error
from memfit.train import make_toxic_csv


def cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``memfit ARGV`` as ``memfit.cli.main`` answers."""
    parser = argparse.ArgumentParser(prog="memfit")
    sub = parser.add_subparsers(dest="command")
    train_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(join_dash_values(argv))
        except SystemExit as e:
            return (e.code if isinstance(e.code, int) else 2), out.getvalue(), err.getvalue()
        with cli_warnings():
            try:
                code = args.run(args) or 0
            except Exception as e:
                if not is_user_error(e):
                    raise
                print(format_error(e), file=err)
                code = 2
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def toxic_csv(tmp_path_factory):
    return str(make_toxic_csv(tmp_path_factory.mktemp("data") / "toxic.csv", 400, seed=0))
