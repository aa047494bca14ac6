"""Fixtures for the training tests: the SmolLM2 tokenizer alone (no weights) and a tiny random model."""

from __future__ import annotations

import pytest
from helpers import tiny_config

from jaxlora.model.params import build_model, random_model


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """The default model's tokenizer and chat template, read from GGUF metadata (no weights loaded)."""
    import gguf

    from jaxlora.loading.gguf_file import metadata
    from jaxlora.tokenizer import tokenizer_from_gguf

    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    return tokenizer_from_gguf(reader, metadata(reader), source=str(smollm2_gguf_path))


@pytest.fixture(scope="module")
def tiny_model():
    """A tiny random model whose (tied) embeddings are large enough for confident predictions: with
    the default N(0, 0.02) init no logit can exceed ~0.7, so no adapter could lower the loss much."""
    model = random_model(tiny_config(), seed=3)
    arrays = {k: v * 25.0 if k == "embed_tokens.embedding" else v for k, v in model.flat_params().items()}
    return build_model(model.config, arrays)
