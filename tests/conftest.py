"""Fixtures; the builders they use live in helpers.py (test files import builders from there, never from each other)."""

from __future__ import annotations

import os

import pytest

# the engine's `--compile auto` would compile every tiny model the tests build (tens of seconds each); the tests that
# check the compiled path ask for it (compile=True / --compile on). Inherited by the CLI subprocesses.
os.environ.setdefault("PARADRAFT_COMPILE", "off")

from helpers import make_tokenizer


@pytest.fixture
def chatml_tokenizer():
    return make_tokenizer("chatml")
