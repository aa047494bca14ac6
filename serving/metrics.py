"""Prometheus metrics of one server, in its own CollectorRegistry (several servers can share a process).

Request latencies are observed by the servicers (gRPC and HTTP) as streams run; queue depths,
adapter-pager counters and residency are read from the engine when Prometheus scrapes.

For adapter-aware routers (the Gateway API inference extension's endpoint picker, llm-d, KServe):
  vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}: vLLM's gauge with
    vLLM's labels, so a router's lora-affinity scorer reads a jaxlora replica unchanged. Running:
    adapters pinned by admitted requests; waiting: adapters with more requests in flight than pins
    (queued); max_lora: device adapter slots. Its value is the scrape's Unix time, as vLLM's is the
    time its labels were set (routers take the newest series).
  vllm:num_requests_running / vllm:num_requests_waiting: the queue depths under vLLM's names.
  vllm:kv_cache_usage_perc: the fraction (0..1, vLLM's unit despite the name) of KV pages in use;
    the Gateway API inference extension's model-server protocol requires it for its KV-cache scorer.
  vllm:cache_config_info{block_size, num_gpu_blocks}: 1, labelled with the KV page size in tokens
    and the number of pages (vLLM's info gauge; routers read the pool's size from it).
  vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}: 1 for every registered adapter, at
    the level it can be served from now: "gpu" (in a device slot) or "cpu" (host memory only, a
    page-in away); pinned "true" while running requests hold its slot (it cannot be evicted).
  vllm:num_gpu_loaded_lora_adapters / vllm:max_gpu_lora_adapters: adapters in device slots, and the
    device slots for adapters (slot 0, the base model, not counted). llm-d's LoRA load-state scorer
    reads these three to send a request where its adapter is already on the GPU, or can be.
  vllm:prefix_cache_queries / vllm:prefix_cache_hits: prompt tokens looked up in the prefix cache at
    admission, and those found cached (counters, vLLM's names); jaxlora_prefix_cache_evictions:
    cached KV pages evicted because their memory was needed.
  vllm:num_preemptions_total: requests preempted (row and KV pages taken back, recomputed later).
  jaxlora_adapter_resident{adapter, tier}: 1 while the adapter is usable from that tier: "device"
    (written into a device slot: no page-in needed), "host" (in host memory: every registered
    adapter, paged in within milliseconds on first use).
  jaxlora_adapter_page_in_seconds{tier}: histogram of the time to bring an adapter into a tier:
    "device" from scheduling a host->device page-in to the commit that issues its write, "host"
    the load of a PEFT folder into host memory.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from jaxlora.engine.request import GenerationRequest, RequestOutput

if TYPE_CHECKING:
    from jaxlora.engine.engine import Engine

log = logging.getLogger(__name__)

# Seconds. TTFT and end-to-end span CPU test models to 7B on a GPU; per-token times are ms-scale.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# PagerMetrics counter field -> exported name (all cumulative).
_PAGER_COUNTERS = {
    "hits": "jaxlora_adapter_hits",
    "misses": "jaxlora_adapter_misses",
    "page_ins": "jaxlora_adapter_page_ins",
    "evictions": "jaxlora_adapter_evictions",
    "bytes_moved": "jaxlora_adapter_page_in_bytes",
}


class ServerMetrics:
    """The metrics of one server; `observe_*` are called from gRPC handler threads."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram(
            "jaxlora_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "jaxlora_time_per_output_token_seconds",
            "Mean time between output tokens of one request, after the first.",
            buckets=_PER_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "jaxlora_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generated_tokens = Counter("jaxlora_generation_tokens", "Tokens generated.", registry=self.registry)
        self.prompt_tokens = Counter(
            "jaxlora_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.requests = Counter(
            "jaxlora_requests",
            "Finished generation calls (gRPC and HTTP) by status, named by its gRPC code.",
            ["code"],
            registry=self.registry,
        )
        self.client_cancels = Counter(
            "jaxlora_client_cancels",
            "Generation calls their client abandoned, by how: disconnected (HTTP connection closed while "
            "waiting or streaming), upload (closed mid-body), cancelled (gRPC cancel), deadline (gRPC deadline).",
            ["reason"],
            registry=self.registry,
        )
        self.adapter_requests = Counter(
            "jaxlora_adapter_requests",
            'Admitted generation calls per adapter ("" = base model).',
            ["adapter"],
            registry=self.registry,
        )
        self.in_flight = _InFlight()
        self.registry.register(_EngineCollector(engine, self.in_flight))
        self._http = None
        self._http_thread: threading.Thread | None = None

    def observe_finished(
        self, *, arrival: float, first_token: float | None, end: float, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """One request that produced its last token at `end` (perf_counter seconds)."""
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if completion_tokens > 1:
                self.tpot.observe((end - first_token) / (completion_tokens - 1))
        self.generated_tokens.inc(completion_tokens)
        self.prompt_tokens.inc(prompt_tokens)

    def submit(self, engine: Engine, request: GenerationRequest, callback: Callable[[RequestOutput], None]) -> None:
        """`engine.submit(request, callback)`, counting the request in flight for its adapter until its
        final update (the waiting adapters of `vllm:lora_requests_info`). Raises what submit raises."""
        adapter = request.adapter or ""
        self.in_flight.add(adapter)

        def forward(out: RequestOutput) -> None:
            if out.finished:
                self.in_flight.remove(adapter)
            callback(out)

        try:
            engine.submit(request, callback=forward)
        except BaseException:
            self.in_flight.remove(adapter)
            raise
        self.adapter_requests.labels(adapter=adapter).inc()

    def serve_http(self, host: str, port: int) -> int:
        """Starts the /metrics HTTP endpoint on a daemon thread; returns the bound port."""
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        """Stops the HTTP endpoint without waiting (its loop polls for shutdown every 0.5 s)."""
        if self._http is not None:
            http, self._http = self._http, None
            threading.Thread(target=lambda: (http.shutdown(), http.server_close()), daemon=True).start()


class _InFlight:
    """Requests submitted and not finished, per adapter ("" = base model); thread-safe."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, adapter: str) -> None:
        with self._lock:
            self._counts[adapter] += 1

    def remove(self, adapter: str) -> None:
        with self._lock:
            self._counts[adapter] -= 1
            if self._counts[adapter] <= 0:
                del self._counts[adapter]

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _EngineCollector:
    """Reads queue depths, pager counters and adapter residency from the engine at scrape time."""

    def __init__(self, engine: Engine, in_flight: _InFlight) -> None:
        self._engine = engine
        self._in_flight = in_flight

    def describe(self) -> list:
        return []  # names are only known at collect time; nothing to pre-register

    def collect(self):
        try:
            stats = self._engine.stats()
            adapters = self._engine.list_adapters()
        except Exception:  # the engine may be mid-step; a scrape must never fail the server
            log.exception("reading the engine failed during a metrics scrape")
            return
        for prefix, suffix in (("jaxlora_requests_", ""), ("vllm:num_requests_", " (vLLM's name)")):
            yield GaugeMetricFamily(
                f"{prefix}running", f"Requests holding a batch row{suffix}.", value=stats["running"]
            )
            yield GaugeMetricFamily(
                f"{prefix}waiting", f"Requests queued for admission{suffix}.", value=stats["waiting"]
            )
        yield from _kv_cache(stats, page_size=self._engine.config.page_size)
        yield from _prefix_cache(stats["prefix_cache"])
        yield CounterMetricFamily(
            "vllm:num_preemptions",
            "Requests preempted (row and KV pages taken back, recomputed later) (vLLM's name).",
            value=stats["preemptions"],
        )
        pager = self._engine.pager
        if pager is None:  # an engine serving the base model alone
            return
        metrics = pager.metrics  # every AdapterSource keeps PagerMetrics
        for field, name in _PAGER_COUNTERS.items():
            yield CounterMetricFamily(name, f"Adapter pager: {field.replace('_', ' ')}.", value=getattr(metrics, field))
        yield _lora_requests_info(adapters, self._in_flight.counts(), max_lora=pager.max_slots - 1)
        yield _residency(adapters)
        yield from _lora_load_state(adapters, max_gpu=pager.max_slots - 1)
        yield _page_in_histogram({"device": metrics.device_page_in, "host": metrics.host_load})


def _prefix_cache(stats: dict) -> list[CounterMetricFamily]:
    return [
        CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=stats["queries"]
        ),
        CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", value=stats["hits"]),
        CounterMetricFamily(
            "jaxlora_prefix_cache_evictions", "Cached KV pages evicted for memory.", value=stats["evictions"]
        ),
    ]


def _lora_requests_info(adapters: list, in_flight: dict[str, int], *, max_lora: int) -> GaugeMetricFamily:
    """vLLM's `vllm:lora_requests_info`: running adapters are those pinned by admitted requests,
    waiting ones have more requests in flight than pins."""
    pins = {a.name: a.in_flight for a in adapters}
    running = sorted(name for name, n in pins.items() if n)
    waiting = sorted(name for name, n in in_flight.items() if name and n > pins.get(name, 0))
    family = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Adapters with running and waiting requests, and the "
        "device adapter slots; the value is the Unix time of the scrape.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    family.add_metric([",".join(running), ",".join(waiting), str(max_lora)], time.time())
    return family


def _kv_cache(stats: dict, *, page_size: int) -> Iterator[GaugeMetricFamily]:
    num_pages = stats["num_pages"]
    usage = 1.0 - stats["free_pages"] / num_pages if num_pages else 0.0
    yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every page is in use.", value=usage)
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "The KV cache's configuration.", labels=["block_size", "num_gpu_blocks"]
    )
    info.add_metric([str(page_size), str(num_pages)], 1.0)
    yield info


def _lora_load_state(adapters: list, *, max_gpu: int) -> Iterator[GaugeMetricFamily]:
    loaded = GaugeMetricFamily(
        "vllm:lora_adapter_loaded",
        "1 per registered adapter at the level it is served from: gpu (a device slot) or cpu (host memory); "
        "pinned while running requests hold its slot.",
        labels=["adapter_name", "level", "pinned", "rank"],
    )
    for a in adapters:
        level = "cpu" if a.resident is None else "gpu"
        loaded.add_metric([a.name, level, str(a.in_flight > 0).lower(), str(a.rank)], 1.0)
    yield loaded
    num_gpu = sum(a.resident is not None for a in adapters)
    yield GaugeMetricFamily("vllm:num_gpu_loaded_lora_adapters", "Adapters in device slots.", value=num_gpu)
    yield GaugeMetricFamily("vllm:max_gpu_lora_adapters", "Device slots for adapters.", value=max_gpu)


def _residency(adapters: list) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        "jaxlora_adapter_resident",
        "1 if the adapter is usable from this tier: device (written in a device slot), host (in host memory).",
        labels=["adapter", "tier"],
    )
    for a in adapters:
        family.add_metric([a.name, "device"], float(a.resident is not None))
        family.add_metric([a.name, "host"], 1.0)  # every registered adapter keeps its host copy
    return family


def _page_in_histogram(tiers: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "jaxlora_adapter_page_in_seconds",
        "Time to bring an adapter into a tier: device (page-in scheduled to written), host (loaded from disk).",
        labels=["tier"],
    )
    for tier, histogram in tiers.items():
        cumulative = list(itertools.accumulate(histogram.counts()))
        buckets = [(floatToGoString(b), c) for b, c in zip(histogram.buckets, cumulative)]
        family.add_metric([tier], buckets + [("+Inf", cumulative[-1])], sum_value=histogram.sum)
    return family
