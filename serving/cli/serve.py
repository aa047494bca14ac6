"""`jaxlora serve`: the OpenAI-compatible HTTP API on `--port` (8000, as vLLM) and the gRPC API on
`--grpc-port` (50051), one engine in one process; `--no-grpc` or `--no-http` leaves one out. Starts
on the default model with no flags.

Exits 0 after SIGTERM/SIGINT: health goes NOT_SERVING, new streams are refused, in-flight streams get
`--grace-period` seconds to finish and are cancelled after that; a second signal exits at once (128 +
its number). Exit 2 for unusable arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from jaxlora.cli import engine_args
from jaxlora.cli.startup import StartupClock
from jaxlora.errors import JaxloraError

log = logging.getLogger("jaxlora.serve")

HTTP_PORT = 8000
GRPC_PORT = 50051


def add_args(p: argparse.ArgumentParser) -> None:
    engine_args.add_engine_args(p, adapters_help="register a PEFT adapter folder at start-up")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument(
        "--port",
        "--http-port",
        type=int,
        default=None,
        help=f"OpenAI-compatible HTTP API port, as in vLLM (0: any free port; printed at start) (default: {HTTP_PORT})",
    )
    p.add_argument(
        "--grpc-port", type=int, default=None, help=f"gRPC API port (0: any free port) (default: {GRPC_PORT})"
    )
    listeners = p.add_mutually_exclusive_group()
    listeners.add_argument("--no-grpc", action="store_true", help="serve the HTTP API only")
    listeners.add_argument("--no-http", action="store_true", help="serve the gRPC API only")
    p.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        metavar="DIR",
        help="folder LoadAdapter may read adapters from (repeatable; none: no runtime loading)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("JAXLORA_API_KEY"),
        help="require 'authorization: Bearer KEY' on every RPC (default: $JAXLORA_API_KEY)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("JAXLORA_ADMIN_KEY"),
        help="require this key for LoadAdapter/UnloadAdapter (default: $JAXLORA_ADMIN_KEY)",
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="without --admin-key, let every caller (with the API key, if one is set) load and unload "
        "adapters at run time (default: refused)",
    )
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--max-concurrent-streams", type=int, default=256, help="Generate calls in flight at most")
    p.add_argument(
        "--grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight streams get at shutdown (a second SIGTERM/SIGINT exits at once)",
    )
    p.add_argument(
        "--http-keep-alive", type=float, default=5.0, help="seconds an idle HTTP connection stays open (default 5)"
    )
    p.add_argument("--max-connections", type=int, default=1024, help="open HTTP connections at most (default 1024)")
    p.add_argument(
        "--max-header-bytes",
        type=int,
        default=16 * 2**10,
        help="largest HTTP request line plus headers (default 16384)",
    )


def run(args: argparse.Namespace) -> int:
    configure_logging()
    clock = StartupClock(getattr(args, "started", None))
    try:
        server = _build(args, clock)
    except (JaxloraError, ValueError, OSError, RuntimeError) as e:
        print(f"jaxlora serve: {e}", file=sys.stderr)
        return 2
    if args.port is not None and args.grpc_port is None and not args.no_grpc:
        print(
            f"jaxlora serve: note: --port {args.port} is the HTTP (OpenAI API) port, as in vLLM; gRPC listens "
            f"on --grpc-port ({GRPC_PORT})",
            file=sys.stderr,
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal(stop))
    server.start()
    print(f"jaxlora serve: listening on {_addresses(args.host, server)} (warming up)", file=sys.stderr, flush=True)
    server.warm_up()
    clock.split(
        {"compile": server.warmup_seconds.get("compile", 0.0), "warm-up run": server.warmup_seconds.get("run", 0.0)}
    )
    clock.print("jaxlora serve", getattr(args, "compilation_cache_dir", None))
    metrics = f", metrics on http://{args.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"jaxlora serve: ready on {_addresses(args.host, server)}{metrics}", file=sys.stderr, flush=True)
    # An engine whose loop died cannot serve again: exit non-zero so that a supervisor restarts us.
    # Polled, not a `stop.set()` from the engine: a supervisor's SIGTERM after a failure is then a
    # first signal (a drain), not the second one that exits at once.
    while not (stop.wait(WAKE_SECONDS) or server.engine.failure is not None):
        pass
    if not stop.is_set():
        print(f"jaxlora serve: the engine failed ({server.engine.failure}); exiting", file=sys.stderr, flush=True)
        server.shutdown(0)
        return 1
    print("jaxlora serve: shutting down", file=sys.stderr, flush=True)
    finished = server.shutdown(args.grace_period)
    if server.engine.failure is not None:
        print(f"jaxlora serve: the engine failed ({server.engine.failure}) while draining", file=sys.stderr, flush=True)
        return 1
    print(
        f"jaxlora serve: stopped ({'all streams finished' if finished else 'some streams were cancelled'})",
        file=sys.stderr,
        flush=True,
    )
    return 0


WAKE_SECONDS = 0.5  # how often the main thread, waiting for a signal, checks the engine is alive


def configure_logging() -> None:
    """The server's own INFO lines on stderr; JAX's backend probing stays quiet (without a TPU it
    logs "Unable to initialize backend 'tpu'" at INFO on every start, which reads like an error)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def _on_signal(stop: threading.Event):
    """The SIGTERM/SIGINT handler: the first sets `stop` (a graceful drain); a second one exits at
    once with 128 + the signal number, for an operator who will not wait for the grace period."""

    def handle(signum: int, frame) -> None:
        if stop.is_set():
            print("jaxlora serve: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        stop.set()

    return handle


def _addresses(host: str, server) -> str:
    """Where it listens: `HOST:PORT` (gRPC) and `http://HOST:PORT` (HTTP), those that are on."""
    grpc_at = [] if server.port is None else [f"{host}:{server.port}"]
    return ", ".join(grpc_at + ([] if server.http_port is None else [f"http://{host}:{server.http_port}"]))


def _build(args: argparse.Namespace, clock: StartupClock | None = None):
    from serving.options import ServerOptions
    from serving.security import AdapterRoots
    from serving.server import build_server

    clock = clock or StartupClock(None)
    clock.lap("import")

    if args.no_grpc and args.grpc_port is not None:
        raise ValueError("--no-grpc and --grpc-port contradict each other")
    if args.no_http and args.port is not None:
        raise ValueError("--no-http and --port (the HTTP port) contradict each other")
    # Options and adapter roots are checked before the model loads, so a typo fails at once.
    options = ServerOptions(
        host=args.host,
        port=None if args.no_grpc else (GRPC_PORT if args.grpc_port is None else args.grpc_port),
        http_port=None if args.no_http else (HTTP_PORT if args.port is None else args.port),
        api_key=args.api_key or None,
        admin_key=args.admin_key or None,
        allow_runtime_updates=args.allow_runtime_lora_updating,
        adapter_roots=tuple(args.adapter_root),
        metrics_port=args.metrics_port,
        max_concurrent_streams=args.max_concurrent_streams,
        grace_seconds=args.grace_period,
        http_keep_alive_seconds=args.http_keep_alive,
        max_connections=args.max_connections,
        max_header_bytes=args.max_header_bytes,
        model_name=engine_args.base_model_name(args),
    )
    AdapterRoots(options.adapter_roots)
    _check_ports_free(options)
    engine = engine_args.engine_from_args(args, clock=clock)
    server, _ = build_server(engine, options)
    return server


def _check_ports_free(options) -> None:
    """OSError naming the first port another process listens on, found before the model loads
    (the servers bind for real once the engine is built)."""
    import socket

    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    for flag, port in (
        ("--grpc-port", options.port),
        ("--port", options.http_port),
        ("--metrics-port", options.metrics_port),
    ):
        if not port:  # off, or any free port
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((options.host, port))
            except OSError as e:
                raise OSError(f"{flag} {port}: cannot listen on {options.host}:{port} ({e.strerror})") from None
