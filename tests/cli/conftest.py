"""Tiny models as config files, so CLI tests run the real command on a model of seconds."""

import pytest

from memfit import zoo


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory):
    """A folder holding a tiny GPT-2 config.json (causal LM), for --config."""
    path = tmp_path_factory.mktemp("tiny-gpt2")
    cfg = zoo.get("gpt2").config(tiny=True)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(path)
    return str(path)
