"""Tiny models as config files, so CLI tests run the real command on a model of seconds."""

import pytest


@pytest.fixture(scope="session")
def tiny_gpt2(tiny_gpt2_config):
    """A folder holding a tiny GPT-2 config.json (causal LM), for --config (tests/conftest)."""
    return tiny_gpt2_config
