"""`jaxlora serve`: the gRPC server (see serving/README.md). Starts on the default model with no flags.

Exits 0 after SIGTERM/SIGINT: health goes NOT_SERVING, new streams are refused, in-flight streams get
`--grace-period` seconds to finish and are cancelled after that. Exit 2 for unusable arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from jaxlora.cli.common import DTYPES, add_model_args, parse_adapter_flags
from jaxlora.errors import JaxloraError

log = logging.getLogger("jaxlora.serve")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port; printed at start)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="register a PEFT adapter folder at start-up (repeatable)")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="folder LoadAdapter may read adapters from (repeatable; none: no runtime loading)")
    p.add_argument("--config", type=Path, default=None, help="engine config YAML (see configs/)")
    p.add_argument("--api-key", default=os.environ.get("JAXLORA_API_KEY"),
                   help="require 'authorization: Bearer KEY' on every RPC (default: $JAXLORA_API_KEY)")
    p.add_argument("--admin-key", default=os.environ.get("JAXLORA_ADMIN_KEY"),
                   help="require this key for LoadAdapter/UnloadAdapter (default: $JAXLORA_ADMIN_KEY)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--max-slots", type=int, default=None, help="device adapter slots, slot 0 included")
    p.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="adapters kept in host memory at most")
    p.add_argument("--max-concurrent-streams", type=int, default=256, help="Generate calls in flight at most")
    p.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight streams get at shutdown")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = _build(args)
    except (JaxloraError, ValueError, OSError, RuntimeError, argparse.ArgumentTypeError) as e:
        print(f"jaxlora serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    server.start()
    print(f"jaxlora serve: listening on {args.host}:{server.port} (warming up)", file=sys.stderr, flush=True)
    server.warm_up()
    metrics = f", metrics on http://{args.host}:{server.metrics_port}/metrics" if server.metrics_port else ""
    print(f"jaxlora serve: ready on {args.host}:{server.port}{metrics}", file=sys.stderr, flush=True)
    stop.wait()
    print("jaxlora serve: shutting down", file=sys.stderr, flush=True)
    finished = server.shutdown(args.grace_period)
    print(f"jaxlora serve: stopped ({'all streams finished' if finished else 'some streams were cancelled'})",
          file=sys.stderr, flush=True)
    return 0


def _build(args: argparse.Namespace):
    from jaxlora.adapters import Pager
    from jaxlora.adapters.registry import slot_nbytes
    from jaxlora.engine import Engine, EngineConfig
    from jaxlora.loading import load_model
    from serving.server import ServerOptions, build_server

    adapters = parse_adapter_flags(args.adapter)
    config = EngineConfig.from_yaml(args.config) if args.config else EngineConfig()
    lora = dataclasses.replace(config.lora, **{k: v for k, v in (("max_slots", args.max_slots),
                                                                ("max_rank", args.max_lora_rank)) if v is not None})
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype])
    capacity = config.host_capacity_bytes
    if args.max_cpu_loras is not None:
        if args.max_cpu_loras < 1:
            raise ValueError(f"--max-cpu-loras={args.max_cpu_loras} must be >= 1")
        capacity = args.max_cpu_loras * slot_nbytes(model.config, lora, model.dtype)
    config = dataclasses.replace(config, lora=lora, host_capacity_bytes=capacity)
    pager = Pager(model.config, lora, host_capacity_bytes=capacity, dtype=model.dtype)
    for name, path in adapters.items():
        pager.register(name, path)
        log.info("registered adapter %r from %s", name, path)
    engine = Engine(model, tokenizer, config, pager)
    options = ServerOptions(host=args.host, port=args.port, api_key=args.api_key or None,
                            admin_key=args.admin_key or None, adapter_roots=tuple(args.adapter_root),
                            metrics_port=args.metrics_port, max_concurrent_streams=args.max_concurrent_streams,
                            grace_seconds=args.grace_period,
                            model_name=str(args.model) if args.model else "SmolLM2-135M-Instruct")
    server, _ = build_server(engine, options)
    return server
