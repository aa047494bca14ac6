"""Fixtures for the training tests: a tiny random model (the SmolLM2 tokenizer is in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.factories import confident_model


@pytest.fixture(scope="module")
def tiny_model():
    """A tiny random model confident enough for training to lower its loss (`confident_model`)."""
    return confident_model()
