"""HTTP without gRPC, on the tiny engine of the gRPC tests: `ServerOptions(port=None)` and the serve
command's `--no-grpc` (`jaxlora serve --http-port` as a process is in test_lifecycle.py)."""

from __future__ import annotations

import signal
import threading

import openai
import pytest

from jaxlora.cli.main import main as jaxlora_main
from serving.options import ServerOptions
from serving.server import build_server


def test_http_alone_serves_the_openai_client(engine, adapter_root):
    server, port = build_server(engine, ServerOptions(port=None, http_port=0, adapter_roots=(str(adapter_root),)))
    assert port is None and server.port is None and server.http_port > 0
    server.start()
    server.warm_up()
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0, timeout=120
        )
        answer = client.completions.create(model="alpha", prompt="hello", max_tokens=3, temperature=0)
        assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length"
    finally:
        server.shutdown(grace_seconds=0)
    assert not engine.is_running


def test_some_protocol_is_needed():
    with pytest.raises(ValueError, match="gRPC port, an HTTP port, or both"):
        ServerOptions(port=None, http_port=None)
    with pytest.raises(ValueError, match="http_port=70000"):
        ServerOptions(http_port=70000)


def test_no_grpc_with_a_grpc_port_is_refused(capsys):
    assert jaxlora_main(["serve", "--no-grpc", "--grpc-port", "1"]) == 2
    assert "--no-grpc and --grpc-port contradict" in capsys.readouterr().err


def test_a_second_signal_exits_at_once(monkeypatch, capsys):
    from serving.cli import serve

    exits = []
    monkeypatch.setattr(serve.os, "_exit", exits.append)
    stop = threading.Event()
    handle = serve._on_signal(stop)
    handle(signal.SIGTERM, None)
    assert stop.is_set() and exits == []  # the first one drains
    handle(signal.SIGINT, None)
    assert exits == [128 + signal.SIGINT] and "second signal" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(http_keep_alive_seconds=0), "http_keep_alive_seconds=0"),
        (dict(max_connections=0), "max_connections=0"),
        (dict(max_header_bytes=100), "max_header_bytes=100"),
    ],
)
def test_connection_limits_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        ServerOptions(**kw)
