"""`jaxlora serve`: the gRPC server, and with `--http-port` the OpenAI-compatible HTTP API beside it
(same engine, same process; `--no-grpc` for HTTP alone). Starts on the default model with no flags.

Exits 0 after SIGTERM/SIGINT: health goes NOT_SERVING, new streams are refused, in-flight streams get
`--grace-period` seconds to finish and are cancelled after that. Exit 2 for unusable arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from jaxlora.cli import engine_args
from jaxlora.errors import JaxloraError

log = logging.getLogger("jaxlora.serve")


def add_args(p: argparse.ArgumentParser) -> None:
    engine_args.add_engine_args(p, adapters_help="register a PEFT adapter folder at start-up")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port; printed at start)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API on this port (0: any free port)",
    )
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only (needs --http-port)")
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
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--max-concurrent-streams", type=int, default=256, help="Generate calls in flight at most")
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight streams get at shutdown")


def run(args: argparse.Namespace) -> int:
    from jaxlora.cli.startup import StartupClock

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    clock = StartupClock(getattr(args, "started", None))
    try:
        server = _build(args, clock)
    except (JaxloraError, ValueError, OSError, RuntimeError) as e:
        print(f"jaxlora serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    server.start()
    print(f"jaxlora serve: listening on {_addresses(args.host, server)} (warming up)", file=sys.stderr, flush=True)
    server.warm_up()
    clock.split(
        {"compile": server.warmup_seconds.get("compile", 0.0), "warm-up run": server.warmup_seconds.get("run", 0.0)}
    )
    clock.print("jaxlora serve", getattr(args, "compilation_cache_dir", None))
    metrics = f", metrics on http://{args.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"jaxlora serve: ready on {_addresses(args.host, server)}{metrics}", file=sys.stderr, flush=True)
    stop.wait()
    print("jaxlora serve: shutting down", file=sys.stderr, flush=True)
    finished = server.shutdown(args.grace_period)
    print(
        f"jaxlora serve: stopped ({'all streams finished' if finished else 'some streams were cancelled'})",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _addresses(host: str, server) -> str:
    """Where it listens: `HOST:PORT` (gRPC) and `http://HOST:PORT` (HTTP), those that are on."""
    grpc_at = [] if server.port is None else [f"{host}:{server.port}"]
    return ", ".join(grpc_at + ([] if server.http_port is None else [f"http://{host}:{server.http_port}"]))


def _build(args: argparse.Namespace, clock):
    from serving.options import ServerOptions
    from serving.security import AdapterRoots
    from serving.server import build_server

    clock.lap("import")

    if args.no_grpc and args.http_port is None:
        raise ValueError("--no-grpc needs --http-port")
    # Options and adapter roots are checked before the model loads, so a typo fails at once.
    options = ServerOptions(
        host=args.host,
        port=None if args.no_grpc else args.port,
        http_port=args.http_port,
        api_key=args.api_key or None,
        admin_key=args.admin_key or None,
        adapter_roots=tuple(args.adapter_root),
        metrics_port=args.metrics_port,
        max_concurrent_streams=args.max_concurrent_streams,
        grace_seconds=args.grace_period,
        model_name=str(args.model) if args.model else "SmolLM2-135M-Instruct",
    )
    AdapterRoots(options.adapter_roots)
    engine = engine_args.engine_from_args(args, clock=clock)
    server, _ = build_server(engine, options)
    return server
