"""Streaming generation over gRPC: same tokens as offline, metrics, and a bounded load test."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from concurrent import futures

import numpy as np

from jaxlora.engine import GenerationRequest, SamplingParams
from serving.gen import inference_pb2 as pb
from tests.serving.support import ADAPTERS, ENGINE_CONFIG, BackgroundStream, assert_capacity_whole, connect

# (adapter, prompt, sampling): every adapter, the base model, a chat prompt, a seeded sample, a stop string.
CASES = [
    ("alpha", "The quick brown fox", dict(max_tokens=24)),
    ("beta", "The quick brown fox", dict(max_tokens=24)),
    ("gamma", "jumps over", dict(max_tokens=17)),
    ("delta", "the lazy dog", dict(max_tokens=30)),  # a fourth adapter: 3 slots, so it pages
    ("", "The quick brown fox", dict(max_tokens=24)),
    ("beta", "sampled", dict(max_tokens=20, temperature=0.9, top_p=0.9, top_k=20, seed=1234)),
    ("alpha", "Hello there, general", dict(max_tokens=40, stop=("zz",))),
]


def _offline(engine, i, adapter, prompt, sampling):
    req = GenerationRequest(
        request_id=f"offline-{i}", prompt=prompt, adapter=adapter or None, sampling=SamplingParams(**sampling)
    )
    return engine.generate([req])[0]


def test_concurrent_streams_with_different_adapters_match_offline(engine, server):
    expected = [_offline(engine, i, *case) for i, case in enumerate(CASES)]  # each alone in its batch
    assert all(e.error is None for e in expected)
    assert len({e.token_ids for e in expected[:2]}) == 2, "adapters must change the output"
    with connect(server) as client:
        streams = [
            BackgroundStream(client, prompt, adapter=adapter, request_id=f"s{i}", **sampling)
            for i, (adapter, prompt, sampling) in enumerate(CASES)
        ]
        for i, (stream, want) in enumerate(zip(streams, expected)):
            stream.join()
            assert stream.error is None, stream.error
            assert tuple(stream.token_ids) == want.token_ids, CASES[i]
            assert "".join(c.text for c in stream.chunks) == want.text
            last = stream.chunks[-1]
            assert last.request_id == f"s{i}"
            assert (
                pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
                == want.finish_reason.value
            )
            assert last.completion_tokens == len(want.token_ids)
            assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in stream.chunks[:-1])
    assert engine.compiles_after_warmup == 0


def test_chat_messages_and_defaults(client):
    out = client.generate(messages=[{"role": "user", "content": "hi"}], adapter="alpha", temperature=0, max_tokens=5)
    assert out.completion_tokens == len(out.token_ids) <= 5 and out.prompt_tokens > 2
    info = client.server_info()
    assert (
        info.max_new_tokens == ENGINE_CONFIG.max_new_tokens_limit
        and info.max_lora_rank == 4
        and info.max_adapter_slots == 4
    )
    assert "q_proj" in info.target_modules


def test_metrics_endpoint(server, client):
    for adapter in ("alpha", "beta", "alpha"):
        client.generate("metrics", adapter=adapter, temperature=0, max_tokens=6)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    for name in (
        "jaxlora_requests_running",
        "jaxlora_requests_waiting",
        "jaxlora_time_to_first_token_seconds_bucket",
        "jaxlora_time_per_output_token_seconds_bucket",
        "jaxlora_e2e_request_latency_seconds_bucket",
        "jaxlora_generation_tokens_total",
        "jaxlora_adapter_hits_total",
        "jaxlora_adapter_misses_total",
        "jaxlora_adapter_page_ins_total",
        "jaxlora_adapter_page_in_seconds",
    ):
        assert name in text, name
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['jaxlora_adapter_requests_total{adapter="alpha"}'] == 2
    assert samples['jaxlora_requests_total{code="OK"}'] == 3
    assert samples["jaxlora_time_to_first_token_seconds_count"] == 3
    assert samples["jaxlora_generation_tokens_total"] >= 3


def test_load_64_concurrent_clients(engine, server):
    """200 streams from 64 client threads over 5 adapters (3 slots: paging) and the base model."""
    num_clients, num_requests = 64, 200
    rng = random.Random(0)
    jobs = [(rng.choice(ADAPTERS + ("spare-0", "")), rng.randint(4, 24), f"load test {i}") for i in range(num_requests)]
    with connect(server) as admin:
        admin.load_adapter("spare-0", "spare-0")
    results: list[tuple[float, int, str]] = []
    lock = threading.Lock()

    def one(job):
        adapter, max_tokens, prompt = job
        with_client = clients[threading.get_ident() % len(clients)]
        start = time.perf_counter()
        first, tokens, reason = None, 0, None
        for chunk in with_client.stream(prompt, adapter=adapter, temperature=0, max_tokens=max_tokens):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - start
            tokens += len(chunk.token_ids)
            reason = chunk.finish_reason
        with lock:
            results.append((first, tokens, pb.FinishReason.Name(reason)))

    clients = [connect(server) for _ in range(8)]  # streams share a few channels, as real clients do
    try:
        start = time.perf_counter()
        with futures.ThreadPoolExecutor(num_clients) as pool:
            list(pool.map(one, jobs))  # re-raises the first failed stream
        seconds = time.perf_counter() - start
    finally:
        for c in clients:
            c.close()
    assert len(results) == num_requests
    assert all(reason in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH") for _, _, reason in results)
    ttft = np.array([r[0] for r in results if r[0] is not None])
    tokens = sum(r[1] for r in results)
    print(
        f"\nload test: {num_requests} streams, {num_clients} clients, {tokens} tokens in {seconds:.2f} s = "
        f"{tokens / seconds:.0f} tokens/s; TTFT p50 {np.percentile(ttft, 50) * 1e3:.0f} ms, "
        f"p99 {np.percentile(ttft, 99) * 1e3:.0f} ms; pager {engine.stats()['pager']['page_ins']} page-ins"
    )
    assert_capacity_whole(engine, server)
    assert engine.compiles_after_warmup == 0


def test_32_concurrent_streams_match_greedy_references(engine, server):
    """32 streams at once (twice the batch: half wait in the queue) over every adapter and the base
    model: each gets its whole greedy answer, in order, as the engine gives it alone."""
    adapters = ADAPTERS + ("",)
    jobs = [(adapters[i % len(adapters)], f"stream {i} says", 12 + i % 9) for i in range(32)]
    expected = [_offline(engine, i, a, p, dict(max_tokens=n, temperature=0)) for i, (a, p, n) in enumerate(jobs)]
    with connect(server) as client:
        streams = [
            BackgroundStream(client, prompt, adapter=adapter, max_tokens=n, request_id=f"c{i}")
            for i, (adapter, prompt, n) in enumerate(jobs)
        ]
        for i, (stream, want) in enumerate(zip(streams, expected)):
            stream.join()
            assert stream.error is None, (i, stream.error)
            assert tuple(stream.token_ids) == want.token_ids, jobs[i]
            assert "".join(c.text for c in stream.chunks) == want.text
            assert all(c.request_id == f"c{i}" for c in stream.chunks)
            assert stream.chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in stream.chunks[:-1])
            assert stream.chunks[-1].completion_tokens == len(want.token_ids)
    assert_capacity_whole(engine, server)
