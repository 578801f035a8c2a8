"""Fixtures; the builders they use live in helpers.py (test files import builders from there, never from each other)."""

from __future__ import annotations

import pytest

from helpers import make_tokenizer


@pytest.fixture
def chatml_tokenizer():
    return make_tokenizer("chatml")
