"""The client side of `benchmarks/serving/trace.py --api http|grpc`: trace requests sent at their arrival
times to a running `jaxlora serve`, each token's arrival timestamped as the client sees it.

  http: the official `openai` package's `AsyncOpenAI`, streaming completions (`prompt` as token
        ids, one model per adapter), one event loop per worker process;
  grpc: the project's `serving.client.InferenceClient`, one thread per request (its stubs are
        synchronous), the prompt as text of the word tokenizer (one word, one token).

A client parses every streamed chunk on the CPU, so one process can lag a saturated server and
show its own delay as the server's TPOT: the trace is dealt round-robin to several worker
processes. Their timestamps are `time.perf_counter()`, CLOCK_MONOTONIC on Linux, which every
process of the machine shares. This module imports no JAX: workers start in a second or so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import multiprocessing
import queue
import threading
import time
from collections.abc import Sequence

HTTP, GRPC = "http", "grpc"


@dataclasses.dataclass(frozen=True)
class Job:
    """One trace request as a client sends it."""

    index: int
    arrival_s: float  # seconds after the run's start
    adapter: str
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclasses.dataclass
class Seen:
    """What the client saw of one request (perf_counter seconds); `reason` "length" or "stop" once
    it finished, `error` when the call failed."""

    index: int
    sent: float | None = None  # when the client started the call
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    finished: float | None = None
    reason: str | None = None
    error: str | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)


def run_workers(
    api: str, target: str, jobs: Sequence[Job], *, workers: int, timeout_s: float
) -> tuple[float, list[Seen]]:
    """Sends `jobs` from `workers` spawned processes (round-robin). The run starts once every worker
    has imported its client: returns that start (perf_counter seconds; a job is due at start +
    arrival_s) and what the workers saw, by index."""
    ctx = multiprocessing.get_context("spawn")  # the caller may hold threads and a JAX runtime
    results, ready, go, start = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    shares = [list(jobs[i::workers]) for i in range(workers)]
    procs = [
        ctx.Process(target=_worker, args=(api, target, share, timeout_s, results, ready, go, start), daemon=True)
        for share in shares
        if share
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)
    start.value = time.perf_counter() + 0.2
    go.set()
    seen: list[Seen] = []
    deadline = time.perf_counter() + timeout_s + 120
    pending = len(procs)
    while pending:
        try:
            seen.extend(results.get(timeout=1.0))
            pending -= 1
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.perf_counter() > deadline:
                for p in procs:
                    p.kill()
                why = f"exit code {dead[0].exitcode}" if dead else "no answer in time"
                raise RuntimeError(f"a {api} client process failed ({why}); its traceback is above") from None
    for p in procs:
        p.join(30)
    return start.value, sorted(seen, key=lambda s: s.index)


def _worker(api: str, target: str, jobs: list[Job], timeout_s: float, results, ready, go, start) -> None:
    if api == HTTP:
        asyncio.run(_warm_http(target))
    elif api == GRPC:
        import serving.client  # noqa: F401
    else:
        raise ValueError(f"unknown api {api!r}")
    ready.put(True)
    go.wait()
    t0 = start.value
    seen = asyncio.run(_http(target, jobs, t0, timeout_s)) if api == HTTP else _grpc(target, jobs, t0, timeout_s)
    results.put(seen)


async def _http(base_url: str, jobs: list[Job], t0: float, timeout_s: float) -> list[Seen]:
    import openai

    # The client's default pool (1,000 connections) holds a worker's streams in flight.
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=timeout_s)
    try:
        return list(await asyncio.gather(*(_http_one(client, job, t0) for job in jobs)))
    finally:
        await client.close()


async def _warm_http(base_url: str) -> None:
    """One call through the client before the run: its first call imports and builds most of the
    client (seconds on a busy CPU), which would otherwise block the event loop, and every stream
    on it, at the run's first arrivals."""
    import openai
    import openai.resources.completions  # noqa: F401
    import openai.types.completion  # noqa: F401

    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=60)
    try:
        await client.models.list()
    finally:
        await client.close()


async def _http_one(client, job: Job, t0: float) -> Seen:
    seen = Seen(job.index)
    await asyncio.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
    seen.sent = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=job.adapter,
            prompt=list(job.prompt_ids),
            max_tokens=job.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                choice = chunk.choices[0]
                if choice.text:
                    _token(seen, now)
                if choice.finish_reason:
                    seen.finished, seen.reason = now, choice.finish_reason
            if chunk.usage is not None and seen.last is not None:
                # A chunk may carry several tokens (a server behind its client joins them): the
                # usage has the count, the tokens a chunk did not show arrived with the last one.
                missing = chunk.usage.completion_tokens - len(seen.token_times)
                seen.token_times.extend([seen.last] * max(0, missing))
                seen.tokens = chunk.usage.completion_tokens
    except Exception as e:  # the row counts it as rejected; the message says why
        seen.error = f"{type(e).__name__}: {e}"
    return seen


def _token(seen: Seen, now: float) -> None:
    if seen.first is None:
        seen.first = now
    seen.last = now
    seen.tokens += 1
    seen.token_times.append(now)


def _grpc(target: str, jobs: list[Job], t0: float, timeout_s: float) -> list[Seen]:
    from serving.client import InferenceClient

    client = InferenceClient(target, timeout=timeout_s)
    lock = threading.Lock()

    def one(job: Job) -> Seen:
        seen = Seen(job.index)
        time.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
        seen.sent = time.perf_counter()
        prompt = " ".join(f"w{t}" for t in job.prompt_ids)  # the word tokenizer: one word, one token
        try:
            for chunk in client.stream(prompt, adapter=job.adapter, max_tokens=job.max_tokens, temperature=0.0):
                now = time.perf_counter()
                with lock:
                    for _ in chunk.token_ids:
                        _token(seen, now)
                    if chunk.finish_reason:
                        seen.finished = now
                        seen.reason = "length" if chunk.finish_reason == 2 else "stop"
        except Exception as e:
            seen.error = f"{type(e).__name__}: {e}"
        return seen

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        return list(pool.map(one, jobs))
