"""Health, reflection, cancellation at scale, and `jaxlora serve` as a process (SIGTERM -> exit 0)."""

from __future__ import annotations

import contextlib
import io
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jaxlora.cli.main import main as jaxlora_main
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.loading.hf_writer import save_hf_folder
from serving.admission import Phase
from serving.cli import serve as serve_cli
from serving.options import ServerOptions
from serving.server import SERVICE_NAME, InferenceServer, build_server
from tests.factories import char_tokenizer, tiny_model
from tests.serving.support import (
    LONG,
    BackgroundStream,
    assert_capacity_whole,
    connect,
    fail_steps,
    lose_the_device,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]


def test_health_serving_after_warm_up_not_serving_on_drain(engine):
    server, _ = build_server(engine, ServerOptions(port=0))
    server.start()
    try:
        with connect(server) as client:
            assert client.health() == client.health(SERVICE_NAME) == "NOT_SERVING"
            server.warm_up()
            assert client.health() == client.health(SERVICE_NAME) == "SERVING"
            server.drain(grace_seconds=1)
            assert client.health() == client.health(SERVICE_NAME) == "NOT_SERVING"
    finally:
        server.shutdown(grace_seconds=0)


def test_reflection_lists_the_service(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
        methods = {m.name for m in db.FindFileContainingSymbol(SERVICE_NAME).service[0].method}
        assert methods == {"Generate", "LoadAdapter", "UnloadAdapter", "ListAdapters", "GetServerInfo"}


def test_many_cancelled_streams_leave_capacity_whole(engine, server, client):
    """40 streams cancelled while queued, prefilling or decoding, 8 more ended by deadlines; then a full
    batch of 16 streams runs to completion."""
    streams = [
        BackgroundStream(
            client,
            f"cancel {i}",
            adapter=("alpha", "beta", "gamma", "delta", "")[i % 5],
            max_tokens=LONG,
            ignore_eos=True,
        )
        for i in range(40)
    ]
    # Every stream in a handler before any cancel: a call cancelled before its handler starts is
    # never seen by the server (nothing to free, nothing counted), and on a loaded machine the
    # last of 40 calls can still be on its way. None can end meanwhile: LONG tokens take seconds and
    # EOS is ignored (greedy decoding on the random model reaches EOS early on some prompts).
    wait_until(lambda: server.admission.num_streams == len(streams))
    # Deadlines long enough that each call is in its handler before it passes, even on a loaded
    # machine (a call that expires before its handler starts is never seen by the server).
    deadlines = [BackgroundStream(client, f"deadline {i}", max_tokens=LONG, timeout=1.5 + 0.1 * i) for i in range(8)]
    wait_until(lambda: server.admission.num_streams == len(streams) + len(deadlines))
    wait_until(lambda: sum(s.first_chunk.is_set() for s in streams) >= 8)  # some are decoding
    for s in streams:  # at once: none can reach LONG tokens meanwhile
        s.call.cancel()
    codes = [s.join().code for s in streams]
    # A stream may finish just before its cancel lands; most must have been cut short.
    assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.OK}
    assert codes.count(grpc.StatusCode.CANCELLED) >= 30, codes
    for s in deadlines:
        assert s.join().code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert_capacity_whole(engine, server)
    cancels = lambda reason: server.metrics.registry.get_sample_value(  # noqa: E731
        "jaxlora_client_cancels_total", {"reason": reason}
    )
    # Every cancel the server saw is counted once. Which reason a deadline's cancel gets depends on
    # when its request reached the server (serving.server's slack): on a loaded machine a late
    # arrival counts as "cancelled", so the split is bounded, not exact.
    cancelled = codes.count(grpc.StatusCode.CANCELLED)
    wait_until(lambda: cancels("deadline") + cancels("cancelled") == len(deadlines) + cancelled)
    assert cancels("deadline") >= len(deadlines) // 2 and 30 <= cancels("cancelled") <= cancelled + len(deadlines)
    full = [BackgroundStream(client, f"after {i}", max_tokens=20) for i in range(engine.config.max_batch)]
    assert all(len(s.join().token_ids) == 20 for s in full)
    assert_capacity_whole(engine, server)


@pytest.fixture(scope="module")
def tiny_hf_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_hf")
    save_hf_folder(tiny_model(), char_tokenizer(), folder)
    config = folder / "engine.yaml"
    config.write_text(
        "engine:\n  max_batch: 4\n  max_seq_len: 256\n  token_budgets: [32]\n"
        "  page_size: 16\n  max_new_tokens_limit: 192\n  max_queue: 16\n"
        "  lora:\n    max_slots: 4\n    max_rank: 4\n"
    )
    return folder


@contextlib.contextmanager
def serve_process(args: list[str], timeout: float = 180):
    """`jaxlora serve --grpc-port 0 --port 0 ARGS` as a subprocess; yields (process, gRPC port) once it is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxlora.cli.main", "serve", "--grpc-port", "0", "--port", "0", *args],
        cwd=REPO,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []
    ready = threading.Event()
    port: list[int] = []

    def read():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"ready on [\d.]+:(\d+)", line)
            if m:
                port.append(int(m.group(1)))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(timeout) and port, "server did not become ready:\n" + "".join(lines[-30:])
        yield proc, port[0], lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        reader.join(10)


def test_sigterm_drains_and_exits_0(tiny_hf_folder, adapter_root):
    args = [
        "--model",
        str(tiny_hf_folder),
        "--config",
        str(tiny_hf_folder / "engine.yaml"),
        "--adapter",
        f"alpha={adapter_root / 'alpha'}",
        "--adapter-root",
        str(adapter_root),
        "--grace-period",
        "20",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
    ]
    with serve_process(args) as (proc, port, lines):
        import openai

        from serving.client import InferenceClient

        http_port = re.search(r"ready on .*?http://127\.0\.0\.1:(\d+)", "".join(lines)).group(1)
        http = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0)
        # Greedy: OpenAI's default temperature is 1, and a sampled EOS would end the reply early.
        reply = http.completions.create(model="alpha", prompt="hi", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
        with InferenceClient(f"127.0.0.1:{port}", timeout=60) as client:
            assert client.health() == "SERVING"
            assert client.generate("hi", adapter="alpha", temperature=0, max_tokens=4).completion_tokens == 4
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                assert (
                    jaxlora_main(
                        ["client", "--port", str(port), "--adapter", "alpha", "--prompt", "hi", "--max-tokens", "4"]
                    )
                    == 0
                )
            assert len(out.getvalue().rstrip("\n")) > 0
            in_flight = BackgroundStream(client, "drain me", adapter="alpha", max_tokens=150)
            assert in_flight.first_chunk.wait(30)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, "".join(lines[-30:])
            assert in_flight.join().error is None and len(in_flight.token_ids) == 150  # finished within grace
        assert any("shutting down" in line for line in lines)
        assert any("all streams finished" in line for line in lines)


def test_client_cli_reports_errors(server, capsys):
    assert jaxlora_main(["client", "--port", str(server.port), "--adapter", "nope", "--prompt", "hi"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    assert jaxlora_main(["client", "--port", str(server.port), "--list-adapters"]) == 0
    assert "alpha" in capsys.readouterr().out


@pytest.mark.slow
def test_serve_starts_on_the_default_model_with_no_flags(smollm2_gguf_path):
    # smollm2_gguf_path fails in CI (skips elsewhere) when the default model is not installed.
    with serve_process([], timeout=400) as (proc, port, lines):
        from serving.client import InferenceClient

        with InferenceClient(f"127.0.0.1:{port}", timeout=120) as client:
            out = client.generate(messages=[{"role": "user", "content": "Say hi"}], temperature=0, max_tokens=8)
            assert out.completion_tokens > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


def test_client_cli_sends_a_chat_message_unless_raw(engine, server, monkeypatch, capsys):
    sent = []
    real_submit = engine.submit

    def recording_submit(request, callback=None):
        sent.append(request)
        return real_submit(request, callback)

    monkeypatch.setattr(engine, "submit", recording_submit)
    port = str(server.port)
    assert jaxlora_main(["client", "--port", port, "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert jaxlora_main(["client", "--port", port, "--raw", "--prompt", "hi", "--max-tokens", "2"]) == 0
    assert [(r.messages, r.prompt) for r in sent] == [([{"role": "user", "content": "hi"}], None), (None, "hi")]


def test_client_cli_lists_no_adapters_in_words(engine, server, monkeypatch, capsys):
    monkeypatch.setattr(engine, "list_adapters", lambda: [])
    assert jaxlora_main(["client", "--port", str(server.port), "--list-adapters"]) == 0
    assert "no adapters loaded" in capsys.readouterr().out


def test_serve_exits_1_when_its_engine_dies(tiny_hf_folder, monkeypatch, capsys):
    built: list[InferenceServer] = []
    build = serve_cli._build
    monkeypatch.setattr(serve_cli, "_build", lambda *a, **kw: built.append(build(*a, **kw)) or built[-1])

    def kill_the_engine() -> None:
        wait_until(lambda: built and built[0].phase is Phase.SERVING, timeout=300)
        engine = built[0].engine
        lose_the_device(monkeypatch, engine)
        fail_steps(monkeypatch, engine, "injected device fault", times=1)
        engine.submit(GenerationRequest(request_id="trigger", prompt="hi", sampling=SamplingParams(max_tokens=2)))

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threading.Thread(target=kill_the_engine, daemon=True).start()
    try:
        args = ["serve", "--model", str(tiny_hf_folder), "--config", str(tiny_hf_folder / "engine.yaml")]
        code = jaxlora_main([*args, "--grpc-port", "0", "--port", "0"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 1
    assert "the engine failed (RuntimeError: device lost); exiting" in capsys.readouterr().err
