"""Prometheus metrics of one server, in its own CollectorRegistry (several servers can share a process).

Request latencies are observed by the servicer as streams run; queue depths and adapter-pager
counters are read from `engine.stats()` when Prometheus scrapes.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("jaxlora_time_to_first_token_seconds", "Time from request arrival to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("jaxlora_time_per_output_token_seconds",
                              "Mean time between output tokens of one request, after the first.",
                              buckets=_PER_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("jaxlora_e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.generated_tokens = Counter("jaxlora_generation_tokens", "Tokens generated.", registry=self.registry)
        self.prompt_tokens = Counter("jaxlora_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.requests = Counter("jaxlora_requests", "Finished Generate calls by gRPC status code.", ["code"],
                                registry=self.registry)
        self.adapter_requests = Counter("jaxlora_adapter_requests", "Admitted Generate calls per adapter "
                                        "(\"\" = base model).", ["adapter"], registry=self.registry)
        self.registry.register(_EngineCollector(engine))
        self._http = None
        self._http_thread: threading.Thread | None = None

    def observe_finished(self, *, arrival: float, first_token: float | None, end: float, prompt_tokens: int,
                         completion_tokens: int) -> None:
        """One request that produced its last token at `end` (perf_counter seconds)."""
        self.e2e.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if completion_tokens > 1:
                self.tpot.observe((end - first_token) / (completion_tokens - 1))
        self.generated_tokens.inc(completion_tokens)
        self.prompt_tokens.inc(prompt_tokens)

    def serve_http(self, host: str, port: int) -> int:
        """Starts the /metrics HTTP endpoint on a daemon thread; returns the bound port."""
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        return self._http.server_port

    def close(self) -> None:
        """Stops the HTTP endpoint without waiting (its loop polls for shutdown every 0.5 s)."""
        if self._http is not None:
            http, self._http = self._http, None
            threading.Thread(target=lambda: (http.shutdown(), http.server_close()), daemon=True).start()


class _EngineCollector:
    """Reads queue depths and pager counters from the engine at scrape time."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def describe(self) -> list:
        return []  # names are only known at collect time; nothing to pre-register

    def collect(self):
        try:
            stats = self._engine.stats()
        except Exception:  # the engine may be mid-step; a scrape must never fail the server
            log.exception("engine.stats() failed during a metrics scrape")
            return
        yield GaugeMetricFamily("jaxlora_requests_running", "Requests holding a batch row.", value=stats["running"])
        yield GaugeMetricFamily("jaxlora_requests_waiting", "Requests queued for admission.", value=stats["waiting"])
        pager = getattr(self._engine, "pager", None)
        metrics = getattr(pager, "metrics", None)
        if metrics is None:
            return
        for field, name in _PAGER_COUNTERS.items():
            yield CounterMetricFamily(name, f"Adapter pager: {field.replace('_', ' ')}.",
                                      value=getattr(metrics, field, 0))
        samples = _copy_samples(metrics.page_in_seconds)
        quantiles = GaugeMetricFamily("jaxlora_adapter_page_in_seconds",
                                      "Adapter page-in wait (scheduled to written), recent quantiles.",
                                      labels=["quantile"])
        for q in (0.5, 0.99):
            quantiles.add_metric([str(q)], float(np.quantile(samples, q)) if samples else math.nan)
        yield quantiles


def _copy_samples(samples) -> list[float]:
    """A copy of a deque the engine thread appends to (a copy can race with an append: retry)."""
    for _ in range(5):
        try:
            return list(samples)
        except RuntimeError:
            continue
    return []
