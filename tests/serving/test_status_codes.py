"""One test per row of the README's status-code table, each on a real server."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from serving.options import ServerOptions
from serving.server import build_server
from tests.serving.support import (
    LONG,
    BackgroundStream,
    assert_capacity_whole,
    connect,
    rpc_error,
    running_server,
    status_of,
    wait_until,
)

Code = grpc.StatusCode


def test_not_found_unknown_adapter(client):
    e = rpc_error(lambda: client.generate("hi", adapter="no-such-adapter", temperature=0, max_tokens=2))
    assert e.code() is Code.NOT_FOUND and "no-such-adapter" in e.details()
    assert status_of(lambda: client.unload_adapter("no-such-adapter")) is Code.NOT_FOUND


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10_000), "max_tokens"),  # above the engine's max_new_tokens_limit
        (dict(stop_token_ids=[10_000]), "stop_token_ids"),
        (dict(prompt="x" * 5000), "max_seq_len"),  # prompt too long
        (dict(prompt=""), "exactly one of prompt and messages"),
        (dict(messages=[{"role": "user", "content": "hi"}]), "exactly one of prompt and messages"),  # both
    ],
)
def test_invalid_argument_bad_request(client, kw, reason):
    kw = {"prompt": "hello", **kw}
    e = rpc_error(lambda: client.generate(kw.pop("prompt"), **kw))
    assert e.code() is Code.INVALID_ARGUMENT and reason in e.details(), e.details()


def test_invalid_argument_bad_adapter_file(client, adapter_root):
    bad = adapter_root / "corrupt"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]}'
    )
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    e = rpc_error(lambda: client.load_adapter("corrupt", "corrupt"))
    assert e.code() is Code.INVALID_ARGUMENT and "adapter_model.safetensors" in e.details(), e.details()
    assert "corrupt" not in [a.name for a in client.list_adapters()]  # a failed load never registers
    e = rpc_error(lambda: client.load_adapter("bad/name", "spare-1"))
    assert e.code() is Code.INVALID_ARGUMENT and "invalid" in e.details()


def test_resource_exhausted_stream_limit(engine, adapter_root):
    with running_server(engine, max_concurrent_streams=2) as server, connect(server) as client:
        held = [BackgroundStream(client, max_tokens=LONG) for _ in range(2)]
        for s in held:
            assert s.first_chunk.wait(30)
        e = rpc_error(lambda: client.generate("one too many", temperature=0, max_tokens=2))
        assert e.code() is Code.RESOURCE_EXHAUSTED and "too many streams" in e.details()
        for s in held:
            s.call.cancel()
            s.join()
        assert_capacity_whole(engine, server)
        assert client.generate("room again", temperature=0, max_tokens=2).completion_tokens == 2


def test_resource_exhausted_admission_queue(engine):
    """max_batch 16 rows + max_queue 64 waiting: streams beyond that are refused, never queued."""
    with running_server(engine) as server, connect(server) as client:
        streams, refused = [], None
        for i in range(160):  # long streams finish slower than these start: the queue must fill
            s = BackgroundStream(client, f"fill {i}", max_tokens=LONG)
            streams.append(s)
            if s.first_chunk.wait(0.01) and s.error is not None:
                refused = s
                break
        wait_until(lambda: refused is not None or any(s.error is not None for s in streams))
        refused = refused or next(s for s in streams if s.error is not None)
        assert refused.code is Code.RESOURCE_EXHAUSTED and "queue is full" in refused.error.details()
        assert len(streams) > 16 + 64 - 1
        for s in streams:
            s.call.cancel()
        for s in streams:
            s.join()
        assert_capacity_whole(engine, server)


def test_unavailable_while_warming_up_and_draining(engine):
    server, port = build_server(engine, ServerOptions(port=0))
    server.start()
    try:
        with connect(server) as client:
            e = rpc_error(lambda: client.generate("too early", temperature=0, max_tokens=2))
            assert e.code() is Code.UNAVAILABLE and "warming up" in e.details()
            server.warm_up()
            running = BackgroundStream(client, "in flight", max_tokens=60)
            assert running.first_chunk.wait(30)
            drain = threading.Thread(target=server.drain, kwargs=dict(grace_seconds=30))
            drain.start()
            wait_until(lambda: client.health() == "NOT_SERVING")
            e = rpc_error(lambda: client.generate("too late", temperature=0, max_tokens=2))
            assert e.code() is Code.UNAVAILABLE and "shutting down" in e.details()
            drain.join(60)
            assert running.join().error is None and len(running.token_ids) == 60  # finished within grace
    finally:
        server.shutdown(grace_seconds=0)


def test_cancelled_frees_the_row(engine, client, server):
    cancelled_before = engine.stats()["cancelled"]
    stream = BackgroundStream(client, max_tokens=LONG, adapter="gamma")
    assert stream.first_chunk.wait(30)
    stream.call.cancel()
    assert stream.join().code is Code.CANCELLED
    wait_until(lambda: engine.stats()["cancelled"] == cancelled_before + 1)
    assert_capacity_whole(engine, server)
    assert len(stream.token_ids) < LONG


def test_deadline_exceeded_frees_the_row(engine, client, server):
    cancelled_before = engine.stats()["cancelled"]
    e = rpc_error(lambda: client.generate("slow", temperature=0, max_tokens=LONG, adapter="beta", timeout=0.3))
    assert e.code() is Code.DEADLINE_EXCEEDED
    wait_until(lambda: engine.stats()["cancelled"] == cancelled_before + 1)
    assert_capacity_whole(engine, server)


def test_unauthenticated_and_permission_denied(engine, adapter_root):
    with running_server(engine, api_key="user-key", admin_key="admin-key", adapter_roots=(str(adapter_root),)) as srv:
        with connect(srv) as anonymous:
            assert status_of(lambda: anonymous.generate("hi", temperature=0, max_tokens=2)) is Code.UNAUTHENTICATED
            assert anonymous.health() == "SERVING"  # probes need no key
        with connect(srv, api_key="user-key") as user:
            assert user.generate("hi", temperature=0, max_tokens=2).completion_tokens == 2
            assert status_of(lambda: user.load_adapter("spare-2", "spare-2")) is Code.PERMISSION_DENIED


def test_failed_precondition_unload_timeout(engine, adapter_root):
    with (
        running_server(engine, adapter_roots=(str(adapter_root),), unload_timeout_seconds=0.2) as server,
        connect(server) as client,
    ):
        client.load_adapter("spare-3", "spare-3")
        stream = BackgroundStream(client, adapter="spare-3", max_tokens=LONG)
        assert stream.first_chunk.wait(30)
        e = rpc_error(lambda: client.unload_adapter("spare-3"))
        assert e.code() is Code.FAILED_PRECONDITION and "still used" in e.details()
        # The stream was not disturbed: it goes on producing tokens (running all LONG of them would
        # outlast the call's deadline on a loaded 2-core machine), until its client cancels it.
        seen = len(stream.token_ids)
        wait_until(lambda: len(stream.token_ids) > seen + 8)
        assert stream.error is None
        stream.call.cancel()
        assert stream.join().code is Code.CANCELLED
        wait_until(lambda: _unloaded(client, "spare-3"))


def _unloaded(client, name: str) -> bool:
    """Unloads `name`; False while a request still uses it (its cancelled row frees at the next step)."""
    try:
        client.unload_adapter(name)
    except grpc.RpcError as e:
        if e.code() is Code.FAILED_PRECONDITION:
            return False
        raise
    return True


def test_already_exists(client):
    e = rpc_error(lambda: client.load_adapter("alpha", "alpha"))
    assert e.code() is Code.ALREADY_EXISTS


def test_internal_error_in_one_request_spares_the_server(engine, client, monkeypatch):
    real_submit = engine.submit

    def broken_submit(request, callback=None):
        if request.prompt == "boom":
            raise ZeroDivisionError("a bug")
        return real_submit(request, callback)

    monkeypatch.setattr(engine, "submit", broken_submit)
    e = rpc_error(lambda: client.generate("boom", temperature=0, max_tokens=2))
    assert e.code() is Code.INTERNAL and "a bug" not in e.details()  # no internals leak to clients
    assert client.generate("fine", temperature=0, max_tokens=3).completion_tokens == 3


def _raw_call(server, method: str, payload: bytes, *, streaming: bool):
    """Sends `payload` as the request bytes of `method`, as a client that builds messages by hand would."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        if streaming:
            return list(channel.unary_stream(method)(payload, timeout=30))
        return channel.unary_unary(method)(payload, timeout=30)
    finally:
        channel.close()


@pytest.mark.parametrize(
    "method, payload",
    [
        ("Generate", b"\x12\x03\xed\xa0\x80"),  # prompt: a lone surrogate (U+D800) as UTF-8 encoders write it
        ("Generate", b"\x12\x02\xff\xfe"),  # prompt: invalid UTF-8
        ("Generate", b"\x1a\x0b\x0a\x04user\x12\x03\xed\xa0\x80"),  # a chat message's content: lone surrogate
        ("Generate", b"\x12\xff\xff\xff"),  # corrupt: a length past the end of the message
        ("LoadAdapter", b"\x0a\x02\xc3\x28"),  # name: invalid UTF-8
    ],
)
def test_invalid_argument_undecodable_request(server, caplog, method, payload):
    caplog.set_level(logging.INFO)
    e = rpc_error(lambda: _raw_call(server, f"/jaxlora.v1.Inference/{method}", payload, streaming=method == "Generate"))
    assert e.code() is Code.INVALID_ARGUMENT and "does not decode" in e.details(), e.details()
    assert "Exception deserializing" not in caplog.text and "Traceback" not in caplog.text
    assert [r.levelname for r in caplog.records if "undecodable request" in r.getMessage()] == ["WARNING"]


def test_invalid_argument_unknown_field_from_a_newer_client(server):
    """A GenerateRequest field this server does not know would be dropped by protobuf: refused."""
    from serving.gen import inference_pb2 as pb

    payload = pb.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString() + b"\xf8\x3f\x01"  # field 1023
    e = rpc_error(lambda: _raw_call(server, "/jaxlora.v1.Inference/Generate", payload, streaming=True))
    assert e.code() is Code.INVALID_ARGUMENT and "[1023]" in e.details(), e.details()


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([{"role": "x" * 30_000, "content": "hi"}], "longer than 20480 bytes as rendered"),  # the role counts
        ([{"role": "user", "content": ""}] * 5000, "5000 messages cannot fit max_seq_len=4096"),
    ],
    ids=["huge-role", "many-empty-messages"],
)
def test_a_chat_too_large_as_rendered_is_refused_before_templating(engine, client, monkeypatch, messages, reason):
    assert engine.tokenizer.chat_overhead.tokens_per_message == 1  # measured (with the template) before

    def no_templating(*args, **kwargs):
        raise AssertionError("the chat was templated before its size was checked")

    monkeypatch.setattr(type(engine.tokenizer), "apply_chat_template", no_templating)
    e = rpc_error(lambda: client.generate(messages=messages, temperature=0, max_tokens=2))
    assert e.code() is Code.INVALID_ARGUMENT and reason in e.details(), e.details()


def test_cancelled_stream_is_counted_once_and_frees_its_place(engine, server):
    """A client cancel ends the engine request, frees the stream's admission place and counts one
    CANCELLED call and one client cancel ("cancelled"), whether it lands mid-stream or while the
    request still waits for its first token."""

    def sample(name: str, labels: dict) -> float:
        return server.metrics.registry.get_sample_value(name, labels) or 0.0

    cancelled = lambda: sample("jaxlora_requests_total", {"code": "CANCELLED"})  # noqa: E731
    client_cancels = lambda: sample("jaxlora_client_cancels_total", {"reason": "cancelled"})  # noqa: E731
    before = cancelled(), client_cancels(), engine.stats()["cancelled"]
    with connect(server) as client:
        mid = BackgroundStream(client, "mid-stream", max_tokens=LONG)
        assert mid.first_chunk.wait(30)
        mid.call.cancel()
        assert mid.join().code is Code.CANCELLED
        wait_until(lambda: server.admission.num_streams == 0)  # the server has ended the first
        early = BackgroundStream(client, "at once", max_tokens=LONG)
        wait_until(lambda: server.admission.num_streams == 1, interval=0.001)  # the server has the call
        early.call.cancel()
        assert early.join().code is Code.CANCELLED
    assert_capacity_whole(engine, server)
    wait_until(lambda: (cancelled(), client_cancels()) == (before[0] + 2, before[1] + 2))
    assert 1 <= engine.stats()["cancelled"] - before[2] <= 2  # the early one may not have reached the engine
