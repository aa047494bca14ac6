"""Helpers of the serving tests: the tiny engine's configuration, adapter folders, servers, streams."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from jaxlora.config import LoraConfig
from jaxlora.engine import Engine, EngineConfig
from jaxlora.lora.peft_format import save_peft_adapter
from serving.client import InferenceClient
from serving.options import ServerOptions
from serving.server import InferenceServer, build_server
from tests.factories import random_adapter

LORA = LoraConfig(max_slots=4, max_rank=4)  # 3 adapter slots: a fourth adapter in use forces paging
ENGINE_CONFIG = EngineConfig(
    max_batch=16,
    max_seq_len=4096,
    token_budgets=(32,),
    page_size=16,
    max_new_tokens_limit=4000,
    max_queue=64,
    lora=LORA,
)
ADAPTERS = ("alpha", "beta", "gamma", "delta")  # registered at start-up
SPARE_ADAPTERS = tuple(f"spare-{i}" for i in range(6))  # in the adapter root, for LoadAdapter tests
# max_tokens of a stream meant to outlive what a test does to it: thousands of decode steps, several
# seconds even on an idle machine, so a 0.3 s deadline or a cancel always lands first.
LONG = 3900


def write_adapter(folder: Path, model_config, *, seed: int, rank: int = 4) -> Path:
    """A random PEFT adapter folder (lora_alpha = r, so the stored weights are the effective ones)."""
    adapter = random_adapter(folder.name, model_config, modules=LORA.target_modules, rank=rank, rng=seed)
    return save_peft_adapter(folder, weights=adapter.weights, rank=rank, alpha=float(rank))


@contextlib.contextmanager
def running_server(engine: Engine, **options) -> Iterator[InferenceServer]:
    """A started, warmed-up server on an ephemeral loopback port; shut down (cancelling) on exit.
    Runtime adapter changes are on unless `options` say otherwise: most tests load adapters keyless."""
    options.setdefault("allow_runtime_updates", True)
    server, port = build_server(engine, ServerOptions(port=0, **options))
    assert port > 0
    server.start()
    server.warm_up()
    try:
        yield server
    finally:
        server.shutdown(grace_seconds=0)
        assert not engine.is_running


def connect(server: InferenceServer, **kw) -> InferenceClient:
    return InferenceClient(f"127.0.0.1:{server.port}", timeout=kw.pop("timeout", 60), **kw)


def status_of(call) -> grpc.StatusCode:
    """Runs a zero-argument callable expected to fail; returns its status code."""
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    raise AssertionError("the call succeeded")


def rpc_error(call) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as e:
        return e
    raise AssertionError("the call succeeded")


class BackgroundStream:
    """One Generate stream consumed on its own thread; `first_chunk` is set at the first response."""

    def __init__(self, client: InferenceClient, prompt: str = "hello", **kw) -> None:
        # Greedy unless told otherwise: a stream meant to run to max_tokens must not sample EOS.
        self.call = client.stream(prompt, **{"temperature": 0, **kw})
        self.chunks: list = []
        self.error: grpc.RpcError | None = None
        self.first_chunk = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for chunk in self.call:
                self.chunks.append(chunk)
                self.first_chunk.set()
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.first_chunk.set()

    def join(self, timeout: float = 60) -> BackgroundStream:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "stream did not end"
        return self

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK if self.error is None else self.error.code()


def wait_until(predicate, timeout: float = 30, interval: float = 0.02) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def assert_capacity_whole(engine: Engine, server: InferenceServer | None = None) -> None:
    """No row, queue entry, adapter pin or stream is left over."""
    wait_until(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0)
    wait_until(lambda: not engine.pager.snapshot()["refcounts"])
    if server is not None:
        wait_until(lambda: server.admission.num_streams == 0)


def fail_steps(monkeypatch, engine: Engine, message: str, *, times: int, after: int = 0) -> None:
    """engine.step runs `after` more times, then raises RuntimeError(message) `times` times, then
    runs again."""
    original, good, left = engine.step, [after], [times]

    def failing():
        if good[0]:
            good[0] -= 1
            return original()
        if left[0]:
            left[0] -= 1
            raise RuntimeError(message)
        return original()

    monkeypatch.setattr(engine, "step", failing)


def lose_the_device(monkeypatch, engine: Engine) -> None:
    """The KV pool cannot be made again: a failed step then kills the engine's loop."""

    def reset_pool():
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "reset_pool", reset_pool)
