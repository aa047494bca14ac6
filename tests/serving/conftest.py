"""Session fixtures: one tiny engine (warmed up once, by the first server), PEFT adapter folders in an
adapter root, and a server on 127.0.0.1 with port 0 per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from jaxlora.adapters import Pager
from jaxlora.engine import Engine
from serving.client import InferenceClient
from serving.server import InferenceServer
from tests.factories import char_tokenizer, tiny_model
from tests.serving.support import ADAPTERS, ENGINE_CONFIG, LORA, SPARE_ADAPTERS, connect, running_server, write_adapter


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Keeps compiled code between modules (overrides tests/conftest.py's): every module here shares
    the session's warmed-up engine, and its tests check that nothing compiles after warm-up."""
    yield


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("adapter_root")
    config = tiny_model().config
    for i, name in enumerate(ADAPTERS + SPARE_ADAPTERS):
        write_adapter(root / name, config, seed=100 + i)
    return root


@pytest.fixture(scope="session")
def engine(adapter_root) -> Engine:
    model = tiny_model()
    pager = Pager(model.config, LORA, dtype=model.dtype)
    for name in ADAPTERS:
        pager.register(name, adapter_root / name)
    return Engine(model, char_tokenizer(), ENGINE_CONFIG, pager)


@pytest.fixture
def server(engine, adapter_root) -> Iterator[InferenceServer]:
    with running_server(engine, adapter_roots=(str(adapter_root),), metrics_port=0) as srv:
        yield srv


@pytest.fixture
def client(server) -> Iterator[InferenceClient]:
    with connect(server) as c:
        yield c
