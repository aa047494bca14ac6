"""Fixtures for the training tests: the SmolLM2 tokenizer alone (no weights) and a tiny random model."""

from __future__ import annotations

import pytest

from tests.factories import confident_model


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """The default model's tokenizer and chat template, read from GGUF metadata (no weights loaded)."""
    from jaxlora.loading.gguf_file import metadata, open_gguf
    from jaxlora.loading.gguf_tokenizer import tokenizer_from_gguf

    reader = open_gguf(smollm2_gguf_path)
    return tokenizer_from_gguf(reader, metadata(reader), source=str(smollm2_gguf_path))


@pytest.fixture(scope="module")
def tiny_model():
    """A tiny random model confident enough for training to lower its loss (`confident_model`)."""
    return confident_model()
