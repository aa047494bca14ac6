"""The HTTP API against clients that leave, misbehave or send what no client should, on the tiny
engine of the gRPC tests (one server for the module; the engine is the session's, already warm).

Every abandoned request stops within moments and is counted a client cancel; every malformed body is
a 4xx in one log line, never a traceback.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.admission import Phase
from serving.server import InferenceServer
from tests.serving.support import LONG, assert_capacity_whole, running_server, wait_until

MAX_STREAMS = 3
# Seconds from a client's hang-up to its row, pages and pin being free, plus one engine step: on a
# machine loaded enough that a step is a noticeable part of it, the cancel lands at the next one.
FREED_WITHIN = 0.5
KEEP_ALIVE = 2.0
MAX_CONNECTIONS = 8
MAX_HEADER_BYTES = 4096


@pytest.fixture(scope="module")
def live(engine, adapter_root) -> Iterator[InferenceServer]:
    with running_server(
        engine,
        http_port=0,
        adapter_roots=(str(adapter_root),),
        max_concurrent_streams=MAX_STREAMS,
        http_keep_alive_seconds=KEEP_ALIVE,
        max_connections=MAX_CONNECTIONS,
        max_header_bytes=MAX_HEADER_BYTES,
    ) as server:
        yield server


def _metric(server: InferenceServer, name: str, **labels: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


# A request meant to hold its row until the test ends it: greedy and past EOS (the API's default
# temperature 1 may sample EOS, and under load the request then ends by itself first).
HOLD = {"temperature": 0, "ignore_eos": True}


def _counts(server: InferenceServer) -> dict[str, float]:
    return {
        "ok": _metric(server, "jaxlora_requests_total", code="OK"),
        "cancelled": _metric(server, "jaxlora_requests_total", code="CANCELLED"),
        "internal": _metric(server, "jaxlora_requests_total", code="INTERNAL"),
        "disconnected": _metric(server, "jaxlora_client_cancels_total", reason="disconnected"),
        "upload": _metric(server, "jaxlora_client_cancels_total", reason="upload"),
    }


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def _freed_after(engine, hung_up: float) -> float:
    """Seconds from `hung_up` (perf_counter) until the engine runs nothing and pins no adapter."""
    wait_until(
        lambda: engine.stats()["running"] == 0 and not engine.pager.snapshot()["refcounts"],
        timeout=30,
        interval=0.005,
    )
    return time.perf_counter() - hung_up


def _step_seconds(engine, over: float = 0.3) -> float:
    """The engine's current seconds per step, measured over `over` seconds while a request runs."""
    steps, start = engine.stats()["steps"], time.perf_counter()
    time.sleep(over)
    return (time.perf_counter() - start) / max(1, engine.stats()["steps"] - steps)


def _raw(server: InferenceServer, data: bytes, *, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as s:
        s.sendall(data)
        if not read:
            return b""
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def _post(path: str, body: bytes, *, length: int | None = None) -> bytes:
    """A POST of `body` (declared `length` bytes long: default its own length)."""
    length = len(body) if length is None else length
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n"
    return (head + "connection: close\r\n\r\n").encode() + body


# Abandoned requests.


def test_a_client_timeout_cancels_a_whole_completion_at_once(engine, live):
    """`curl -m 1` on a long non-streamed completion: the hang-up frees the row at once."""
    before, cancelled = _counts(live), engine.stats()["cancelled"]
    body = json.dumps({"model": "alpha", "prompt": "hello", "max_tokens": LONG, **HOLD}).encode()
    with socket.create_connection(("127.0.0.1", live.http_port), timeout=30) as s:
        s.sendall(_post("/v1/completions", body))
        wait_until(lambda: engine.stats()["running"] == 1)  # generating, holding its row
        step = _step_seconds(engine)
    freed = _freed_after(engine, time.perf_counter())
    assert freed < FREED_WITHIN + step, (freed, step)
    assert engine.stats()["cancelled"] == cancelled + 1
    wait_until(lambda: _delta(before, _counts(live)) == {"cancelled": 1, "disconnected": 1})
    assert_capacity_whole(engine, live)


def test_an_sdk_timeout_with_retries_runs_one_cancelled_generation_per_attempt(engine, live):
    before, cancelled = _counts(live), engine.stats()["cancelled"]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{live.http_port}/v1", api_key="unused", timeout=1, max_retries=2)
    step: list[float] = []

    def measure_a_step() -> None:
        wait_until(lambda: engine.stats()["running"] == 1)
        step.append(_step_seconds(engine, over=0.2))

    measuring = threading.Thread(target=measure_a_step, daemon=True)
    measuring.start()
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="beta", prompt="hello", max_tokens=LONG, temperature=0)
    freed = _freed_after(engine, time.perf_counter())
    measuring.join(30)
    assert freed < FREED_WITHIN + step[0], (freed, step)
    assert engine.stats()["cancelled"] == cancelled + 3  # three attempts, three generations, each cancelled
    wait_until(lambda: _delta(before, _counts(live)) == {"cancelled": 3, "disconnected": 3})
    assert_capacity_whole(engine, live)


def test_a_stream_whose_client_leaves_without_reading_is_cancelled_too(engine, live):
    cancelled = engine.stats()["cancelled"]
    body = json.dumps({"prompt": "queued", "max_tokens": LONG, "stream": True, **HOLD}).encode()
    with socket.create_connection(("127.0.0.1", live.http_port), timeout=30) as s:
        s.sendall(_post("/v1/completions", body))
        wait_until(lambda: engine.stats()["running"] == 1)
    _freed_after(engine, time.perf_counter())
    wait_until(lambda: engine.stats()["cancelled"] == cancelled + 1, timeout=FREED_WITHIN * 4)


# Bad bodies: a 4xx each, one log line at most, no traceback.


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def _error(response: bytes) -> dict:
    return json.loads(response.partition(b"\r\n\r\n")[2])["error"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"[" * 20_000 + b"]" * 20_000, 400, "nests deeper than"),
        (b'{"prompt": "x", "temperature": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "nests deeper than"),
        (b'{"prompt": "x", "temperature": NaN}', 400, "NaN is not a finite number"),
        (b'{"prompt": "x", "temperature": Infinity}', 400, "Infinity is not a finite number"),
        (b'{"prompt": "x", "temperature": 1e400}', 400, "1e400 is too large to be a finite number"),
        (b'{"prompt": "x\\ud800"}', 400, "prompt holds a lone surrogate (\\ud800 at character 1)"),
        (b'{"messages": [{"role": "\\udfff", "content": "x"}]}', 400, "messages[0].role holds a lone surrogate"),
        (b'{"prompt": "x", "\\ud800": 1}', 400, "a key holds a lone surrogate"),
        (b'{"prompt": "\xff"}', 400, "not UTF-8"),
        (b"{}" + b" " * (4 * 2**20), 413, "larger than 4194304 bytes"),
    ],
    ids=[
        "deep",
        "deep-field",
        "nan",
        "infinity",
        "1e400",
        "surrogate",
        "surrogate-role",
        "surrogate-key",
        "utf8",
        "413",
    ],
)
def test_bad_bodies_are_refused_without_a_traceback(live, capfd, caplog, body, status, message):
    before = _counts(live)
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    if status == 413:  # the body is refused by its declared length, before it is sent
        request = _post(path, b"", length=len(body))
    else:
        request = _post(path, body)
    response = _raw(live, request)
    assert _status(response) == status, response[:300]
    assert message in _error(response)["message"]
    assert _delta(before, _counts(live)) == {}  # refused, neither cancelled nor INTERNAL
    _assert_no_traceback(capfd, caplog)


def test_a_client_that_hangs_up_mid_upload_is_one_log_line_and_a_client_cancel(live, capfd, caplog):
    before = _counts(live)
    with caplog.at_level(logging.INFO, logger="serving.http_server"):
        _raw(live, _post("/v1/completions", b'{"prompt": "xxx', length=1000), read=False)
        wait_until(lambda: _delta(before, _counts(live)) == {"cancelled": 1, "upload": 1})
    assert [r.getMessage() for r in caplog.records if r.name == "serving.http_server"] == [
        "POST /v1/completions: the client hung up mid-upload"
    ]
    _assert_no_traceback(capfd, caplog)


def test_429_and_503_say_when_to_retry(engine, live):
    held = [
        socket.create_connection(("127.0.0.1", live.http_port), timeout=30) for _ in range(MAX_STREAMS)
    ]  # each a stream holding a place
    try:
        for s in held:
            s.sendall(
                _post(
                    "/v1/completions",
                    json.dumps({"prompt": "hold", "max_tokens": LONG, "stream": True, **HOLD}).encode(),
                )
            )
        wait_until(lambda: live.admission.num_streams == MAX_STREAMS)
        response = _raw(live, _post("/v1/completions", b'{"prompt": "one too many", "max_tokens": 2}'))
        assert _status(response) == 429 and b"\r\nretry-after: 1\r\n" in response.lower()
    finally:
        for s in held:
            s.close()
    assert_capacity_whole(engine, live)
    live.admission.set_phase(Phase.DRAINING)
    try:
        response = _raw(live, _post("/v1/completions", b'{"prompt": "draining", "max_tokens": 2}'))
        assert _status(response) == 503 and b"\r\nretry-after: 1\r\n" in response.lower()
        health = _raw(live, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _status(health) == 503 and b"\r\nretry-after: 1\r\n" in health.lower()
    finally:
        live.admission.set_phase(Phase.SERVING)


def _assert_no_traceback(capfd, caplog) -> None:
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_preemptions_are_exported_under_vllm_s_name(engine, live):
    assert _metric(live, "vllm:num_preemptions_total") == engine.stats()["preemptions"]
    assert (
        "vllm:num_preemptions_total"
        in _raw(live, b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").decode()
    )


# Connection limits.


def test_a_connection_that_never_sends_is_closed_after_the_keep_alive(live):
    with socket.create_connection(("127.0.0.1", live.http_port), timeout=KEEP_ALIVE * 10) as s:
        start = time.perf_counter()
        assert s.recv(1) == b""  # closed by the server
        assert KEEP_ALIVE * 0.8 <= time.perf_counter() - start <= KEEP_ALIVE * 5


def test_connections_beyond_the_cap_are_refused_with_503(live):
    held = [socket.create_connection(("127.0.0.1", live.http_port), timeout=30) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection(("127.0.0.1", live.http_port), timeout=30) as extra:
            response = b"".join(iter(lambda: extra.recv(65536), b""))
        assert _status(response) == 503 and b"\r\nretry-after: 1\r\n" in response.lower()
        assert "too many open connections" in _error(response)["message"]
    finally:
        for s in held:
            s.close()
    health = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    wait_until(lambda: _status(_raw(live, health)) == 200)  # room again once they close


def test_a_request_head_beyond_the_bound_is_refused(live):
    health = "GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{}\r\n"
    assert _status(_raw(live, health.format("").encode())) == 200
    big = _raw(live, health.format(f"x-big: {'y' * MAX_HEADER_BYTES}\r\n").encode())
    assert _status(big) == 431 and f"larger than {MAX_HEADER_BYTES} bytes" in _error(big)["message"]
