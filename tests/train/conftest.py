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
from memfit.train import TrainConfig, make_toxic_csv, train
from memfit.train.data import load_table
from memfit.train.tokenizer import train_tokenizer


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


STEPS = 24


def quiet(_text):
    pass


@pytest.fixture(scope="session")
def tokenizer_file(toxic_csv, tmp_path_factory):
    """One tokenizer for every run here, so runs differ only in what is tested."""
    table = load_table(toxic_csv, "comment_text", "toxic")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_tokenizer(table.texts, 1000).backend.save(str(path))
    return str(path)


def config(toxic_csv, tokenizer_file, output, **kw) -> TrainConfig:
    values = dict(data=toxic_csv, output=str(output), model="xlm-roberta-base", tiny=True,
                  tokenizer=tokenizer_file, batch_size=16, max_steps=STEPS, epochs=3, lr=3e-3,
                  max_len=64, warmup_fraction=0.25, save_every=8, eval_every=12, measure_steps=2)
    values.update(kw)
    return TrainConfig(**values)


@pytest.fixture(scope="session")
def full_run(toxic_csv, tokenizer_file, tmp_path_factory):
    cfg = config(toxic_csv, tokenizer_file, tmp_path_factory.mktemp("runs") / "full")
    return cfg, train(cfg, say=quiet)


