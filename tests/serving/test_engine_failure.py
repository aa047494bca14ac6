"""An engine that fails under open streams: every stream ends with a clear error, none hangs.

A step that raises (a device fault the engine recovers from) fails the requests it was running and
the engine serves the next one. A loop that dies (the device cannot even give a fresh KV pool) fails
every live request, turns the server unhealthy for good (HTTP /health 503 with the reason, gRPC
NOT_SERVING), refuses new calls with UNAVAILABLE, and makes `jaxlora serve` exit non-zero so that a
supervisor restarts it.
"""

from __future__ import annotations

import collections
import http.client
import json
import threading
from collections.abc import Iterator

import grpc
import pytest

from jaxlora.adapters import Pager
from jaxlora.engine import Engine
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.errors import EngineFailedError
from serving.admission import Phase
from serving.server import InferenceServer
from tests.factories import char_tokenizer, tiny_model
from tests.serving.support import (
    ADAPTERS,
    ENGINE_CONFIG,
    LONG,
    LORA,
    assert_capacity_whole,
    connect,
    fail_steps,
    lose_the_device,
    running_server,
    wait_until,
)

# Greedy past EOS: the request holds its row until the test ends it.
HOLD = {"temperature": 0, "ignore_eos": True}
ENDS_WITHIN = 20.0  # seconds: a failed stream ends at the next engine step, far sooner


class SseStream:
    """A streamed /v1/completions call read event by event (raw HTTP: the test sees every event)."""

    def __init__(self, server: InferenceServer, adapter: str) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=ENDS_WITHIN)
        body = {"model": adapter, "prompt": "hold this row", "max_tokens": LONG, "stream": True, **HOLD}
        self.conn.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        self.response = self.conn.getresponse()
        if self.response.status != 200:
            raise AssertionError(f"stream refused: {self.response.status} {self.response.read()!r}")

    def events(self) -> Iterator[str]:
        while True:
            line = self.response.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :].strip().decode()
                yield data
                if data == "[DONE]":
                    return

    def first_token(self) -> None:
        for data in self.events():
            if json.loads(data)["choices"][0]["text"]:
                return
        raise AssertionError("the stream ended before its first token")

    def error_at_end(self) -> str:
        """The message of the error event the stream ends with (AssertionError if it ends without)."""
        errors = [json.loads(d)["error"]["message"] for d in self.events() if d != "[DONE]" and '"error"' in d]
        self.conn.close()
        if not errors:
            raise AssertionError("the stream ended without an error event")
        return errors[-1]


def _grpc_stream(server: InferenceServer, adapter: str) -> tuple[threading.Thread, dict]:
    """A gRPC stream on a thread of its own; its outcome lands in the returned dict."""
    outcome: dict = {"tokens": 0}

    def run() -> None:
        with connect(server, timeout=ENDS_WITHIN * 3) as client:
            try:
                for chunk in client.stream("hold this row", adapter=adapter, max_tokens=LONG, **HOLD):
                    outcome["tokens"] += len(chunk.token_ids)
                outcome["error"] = None
            except grpc.RpcError as e:
                outcome["error"] = (e.code(), e.details())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _http_status(server: InferenceServer, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=ENDS_WITHIN)
    conn.request(
        method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read() or b"{}")
    conn.close()
    return status, payload


def test_a_failed_step_fails_every_open_stream_and_the_engine_serves_on(engine, adapter_root, monkeypatch):
    with running_server(engine, http_port=0, adapter_roots=(str(adapter_root),)) as server:
        sse = SseStream(server, ADAPTERS[0])
        sse.first_token()
        thread, outcome = _grpc_stream(server, ADAPTERS[1])
        wait_until(lambda: outcome["tokens"] > 0)

        fail_steps(monkeypatch, engine, "injected device fault", times=1)

        message = sse.error_at_end()
        assert "engine step failed" in message and "injected device fault" in message
        thread.join(ENDS_WITHIN)
        assert not thread.is_alive(), "the gRPC stream hung"
        code, details = outcome["error"]
        assert code == grpc.StatusCode.INTERNAL and "injected device fault" in details
        assert_capacity_whole(engine, server)
        # The engine recovered: the next request is served, and the server stayed healthy.
        assert _http_status(server, "GET", "/health") == (200, {"status": "serving"})
        status, body = _http_status(
            server, "POST", "/v1/completions", {"model": ADAPTERS[0], "prompt": "hi", "max_tokens": 3}
        )
        assert status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.fixture
def doomed_engine(adapter_root) -> Engine:
    """An engine of its own: its loop is killed, and a dead engine cannot start again."""
    model = tiny_model()
    pager = Pager(model.config, LORA, dtype=model.dtype)
    for name in ADAPTERS[:2]:
        pager.register(name, adapter_root / name)
    return Engine(model, char_tokenizer(), ENGINE_CONFIG, pager)


def test_a_dead_engine_loop_fails_every_stream_and_the_server_turns_unhealthy(doomed_engine, monkeypatch):
    engine = doomed_engine
    server_context = running_server(engine, http_port=0)
    server = server_context.__enter__()
    try:
        sse = SseStream(server, ADAPTERS[0])
        sse.first_token()
        thread, outcome = _grpc_stream(server, ADAPTERS[1])
        wait_until(lambda: outcome["tokens"] > 0)
        # The step fails, then the device cannot give a fresh KV pool either: the loop dies. (The pool
        # first: a step failing between the two would otherwise recover.)
        lose_the_device(monkeypatch, engine)
        fail_steps(monkeypatch, engine, "injected device fault", times=1)

        assert "injected device fault" in sse.error_at_end()
        thread.join(ENDS_WITHIN)
        assert not thread.is_alive(), "the gRPC stream hung"
        assert outcome["error"][0] == grpc.StatusCode.INTERNAL
        wait_until(lambda: server.phase is Phase.FAILED, timeout=ENDS_WITHIN)
        assert "device lost" in engine.failure
        # The server turns FAILED from the failure listener, on the loop's thread, before it ends.
        wait_until(lambda: not engine.is_running, timeout=ENDS_WITHIN)

        status, body = _http_status(server, "GET", "/health")
        assert status == 503 and body["status"] == Phase.FAILED.value and "device lost" in body["error"]
        status, body = _http_status(
            server, "POST", "/v1/completions", {"model": ADAPTERS[0], "prompt": "hi", "max_tokens": 3}
        )
        assert (
            status == 503
            and "the engine failed" in body["error"]["message"]
            and "restarted" in body["error"]["message"]
        )
        with connect(server, timeout=ENDS_WITHIN) as client:
            with pytest.raises(grpc.RpcError) as raised:
                client.generate("hi", max_tokens=3)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and "device lost" in raised.value.details()
        with pytest.raises(EngineFailedError, match="device lost"):
            engine.start()
    finally:
        server.shutdown(grace_seconds=0)


def test_a_dead_loop_ends_every_request_once_and_frees_what_they_held(doomed_engine, monkeypatch):
    # Many long prompts on a 32-token budget: after one good step some requests run and most wait in
    # the scheduler with their adapter pinned; two more are submitted as the next step starts (and
    # fails), so they are still in the inbox when the loop dies.
    engine = doomed_engine
    lose_the_device(monkeypatch, engine)
    good_step, calls = engine.step, [0]

    def step():
        calls[0] += 1
        if calls[0] == 1:
            return good_step()
        inboxed.extend([submit(20), submit(21, stream=True)])
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(engine, "step", step)
    inboxed: list = []
    heard: list[str] = []
    engine.on_failure(heard.append)
    finals: dict[str, list] = collections.defaultdict(list)

    def submit(i: int, *, stream: bool = False):
        rid = f"r{i}"
        callback = None if stream else (lambda out: finals[out.request_id].append(out) if out.finished else None)
        prompt = "a prompt of some thirty characters " * 2
        request = GenerationRequest(
            request_id=rid, prompt=prompt, adapter=ADAPTERS[i % 2], sampling=SamplingParams(max_tokens=50)
        )
        return engine.submit(request, callback, stream=stream)

    for i in range(12):
        submit(i)
    streamed = submit(12, stream=True)
    engine.start()
    wait_until(lambda: heard, timeout=ENDS_WITHIN)
    assert heard == ["RuntimeError: device lost"]
    with pytest.raises(EngineFailedError, match="the engine failed and takes no requests"):
        submit(13)

    for rid in (f"r{i}" for i in range(12)):
        outs = finals[rid]
        assert len(outs) == 1 and outs[0].finish_reason.name == "ERROR", (rid, outs)
    errors = {out.error for outs in finals.values() for out in outs}
    assert "the engine failed: RuntimeError: device lost" in errors  # the waiting ones: ended by the loop's end
    stream = list(streamed)
    assert [o.finished for o in stream].count(True) == 1 and stream[-1].error.startswith("the engine")
    died = "the engine failed: RuntimeError: device lost"
    assert [(o.finish_reason.name, o.error) for o in finals["r20"]] == [("ERROR", died)]  # from the inbox
    assert [(o.finished, o.error) for o in inboxed[1]] == [(True, died)]
    assert all(h.result(0).error == died for h in inboxed)
    # Nothing is held: rows, queue, pins.
    stats = engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0 and not engine.has_work()
    assert not engine.pager.snapshot()["refcounts"]
    engine.unregister_adapter(ADAPTERS[0], timeout=ENDS_WITHIN)  # no request pins it
    with pytest.raises(EngineFailedError, match="runs no steps"):
        Engine.step(engine)  # the engine's own step, not the test's wrapper
    with pytest.raises(EngineFailedError, match="cannot start again"):
        engine.start()
