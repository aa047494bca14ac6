"""One warmed-up engine (tiny random model, char tokenizer, real pager, 5 adapters over 3 slots)
shared by the engine tests: warm-up compiles are the expensive part on a 2-core CI machine."""

from __future__ import annotations

import pytest

from jaxlora.config import LoraConfig
from jaxlora.engine.config import EngineConfig
from jaxlora.engine.engine import Engine
from tests.factories import char_tokenizer, random_adapter, tiny_model

ADAPTERS = ("a0", "a1", "a2", "a3", "a4")


def engine_config(**overrides) -> EngineConfig:
    base = dict(
        max_batch=4,
        max_seq_len=64,
        token_budgets=(8, 16),
        page_size=4,
        max_new_tokens_limit=32,
        max_queue=64,
        max_wait_steps=8,
        lora=LoraConfig(max_slots=4, max_rank=4),
    )
    base.update(overrides)
    return EngineConfig(**base)


@pytest.fixture(scope="session")
def parts():
    """(model, tokenizer, {name: HostAdapter})."""
    model, tok = tiny_model(), char_tokenizer()
    lora = engine_config().lora
    adapters = {
        name: random_adapter(name, model.config, modules=lora.target_modules, rng=i + 1)
        for i, name in enumerate(ADAPTERS)
    }
    return model, tok, adapters


def make_engine(parts, progress=None, **overrides) -> Engine:
    from jaxlora.adapters import Pager

    model, tok, adapters = parts
    config = engine_config(**overrides)
    pager = Pager(model.config, config.lora, dtype=model.dtype)
    for name, adapter in adapters.items():
        pager.register(name, adapter)
    engine = Engine(model, tok, config, pager)
    engine.warmup(progress)
    return engine


@pytest.fixture(scope="module")
def engine(parts) -> Engine:
    return make_engine(parts)
