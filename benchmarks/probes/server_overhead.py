"""Where time goes between the engine loop and a client: one batch of streams on a toy model, in
process (a callback per token) and through the server (HTTP with the openai client, gRPC with
serving.client, from client processes), with the engine loop's host time per step by phase.

    python -m benchmarks.probes.server_overhead --streams 64 --tokens 128       # writes results/probes/server_overhead/

The toy model's step is short, so the loop's host time is most of a step: whatever the server adds
to the engine thread per token (handing tokens to the streams, and the GIL the frontends hold while
they frame and send) shows as a longer step and a longer TPOT than in process. Per mode a row has:
  wall_s: the batch from the first submission to the last token seen by a client;
  steps, host_ms_per_step and each phase's ms per step (`jaxlora.engine.host_timing`), of which
    "stream" holds the per-token hand-off to the frontends;
  step_ms: wall time per engine step over the batch; tpot_ms_p50 / p99 as clients saw them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import TINY, word_tokenizer
from benchmarks.paths import results_dir
from benchmarks.serving.clients import GRPC, HTTP, Job, run_workers
from jaxlora.engine import Engine, EngineConfig
from jaxlora.engine.host_timing import per_step
from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.model.params import random_model

RESULTS = results_dir(__file__) / "server_overhead.json"


def make_engine(streams: int, tokens: int) -> Engine:
    config = EngineConfig(
        max_batch=streams,
        max_seq_len=tokens + 32,
        token_budgets=(streams,),
        page_size=16,
        max_new_tokens_limit=tokens,
        max_queue=4 * streams,
    )
    model = random_model(TINY, fused=True)
    engine = Engine(model, word_tokenizer(TINY.vocab_size), config)
    engine.warmup()
    return engine


def _prompts(streams: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(1, TINY.vocab_size, 16).tolist()) for _ in range(streams)]


def run_inprocess(engine: Engine, streams: int, tokens: int) -> tuple[float, list[list[float]]]:
    times: list[list[float]] = [[] for _ in range(streams)]
    remaining = [streams]
    done = threading.Event()

    def callback(i: int):
        def on(out) -> None:  # on the engine thread
            if out.token_ids:
                times[i].append(time.perf_counter())
            if out.finished:
                remaining[0] -= 1
                if not remaining[0]:
                    done.set()

        return on

    start = time.perf_counter()
    for i, prompt in enumerate(_prompts(streams)):
        request = GenerationRequest(
            request_id=f"p{i}", prompt_ids=list(prompt), sampling=SamplingParams(max_tokens=tokens)
        )
        engine.submit(request, callback=callback(i))
    done.wait()
    return start, times


def run_server(api: str, server, streams: int, tokens: int, workers: int) -> tuple[float, list[list[float]]]:
    jobs = [
        Job(index=i, arrival_s=0.0, adapter="", prompt_ids=p, max_tokens=tokens)
        for i, p in enumerate(_prompts(streams))
    ]
    if api == HTTP:
        jobs = [
            Job(index=j.index, arrival_s=0.0, adapter="base", prompt_ids=j.prompt_ids, max_tokens=tokens) for j in jobs
        ]
    target = f"http://127.0.0.1:{server.http_port}/v1" if api == HTTP else f"127.0.0.1:{server.port}"
    start, seen = run_workers(api, target, jobs, workers=workers, timeout_s=600)
    errors = [s.error for s in seen if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed, e.g. {errors[0]}")
    return start, [s.token_times for s in seen]


def row(mode: str, engine: Engine, before: dict, start: float, times: list[list[float]]) -> dict:
    after = engine.stats()
    steps = after["host"]["steps"] - before["host"]["steps"]
    end = max(t[-1] for t in times)
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    out = {
        "mode": mode,
        "wall_s": round(end - start, 3),
        "steps": steps,
        "step_ms": round((end - start) / steps * 1e3, 3) if steps else None,
        "tokens_seen": sum(len(t) for t in times),
        "tpot_ms_p50": round(float(np.percentile(tpot, 50)) * 1e3, 3),
        "tpot_ms_p99": round(float(np.percentile(tpot, 99)) * 1e3, 3),
    }
    out.update({k.replace("_ms", "_ms_per_step"): v for k, v in per_step(before["host"], after["host"]).items()})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=["inprocess", HTTP, GRPC])
    p.add_argument("--client-workers", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from serving.options import ServerOptions
    from serving.server import build_server

    engine = make_engine(args.streams, args.tokens)
    server, _ = build_server(engine, ServerOptions(port=0, http_port=0, model_name="base", max_concurrent_streams=1024))
    server.start()
    server.warm_up()
    rows = []
    try:
        for mode in args.modes:
            before = engine.stats()
            if mode == "inprocess":
                start, times = run_inprocess(engine, args.streams, args.tokens)
            else:
                start, times = run_server(mode, server, args.streams, args.tokens, args.client_workers)
            rows.append(row(mode, engine, before, start, times))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.shutdown(grace_seconds=0)
    result = {
        "streams": args.streams,
        "tokens": args.tokens,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
