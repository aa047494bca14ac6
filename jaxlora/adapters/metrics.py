"""Counters the pager keeps: how often adapters were resident, how much was paged in, how long it took."""

from __future__ import annotations

import bisect
import collections
import dataclasses

import numpy as np

# Latency samples kept for percentiles; older ones drop off so a long-running server stays bounded.
MAX_LATENCY_SAMPLES = 10_000

# Seconds: upper bounds of the latency histograms. A host->device page-in is waited for over a few
# steps (ms on a GPU, up to seconds on a busy CPU); a load from disk takes ms to tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LatencyHistogram:
    """Cumulative counts of latencies per bucket (Prometheus histogram semantics, no dependency on it).

    Unlike the bounded sample deques, nothing is ever dropped, so a scraper's rates stay exact.
    `observe` runs under the pager's lock; readers copy with `counts()` (a list copy is atomic).
    """

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        if list(buckets) != sorted(set(buckets)) or not buckets:
            raise ValueError(f"buckets={buckets} must be strictly increasing and non-empty")
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds

    def counts(self) -> list[int]:
        """Observations per bucket (not cumulative), +Inf last."""
        return list(self._counts)

    @property
    def count(self) -> int:
        return sum(self._counts)


@dataclasses.dataclass
class PagerMetrics:
    """Cumulative pager counters (mutated by the pager under its lock; read a `snapshot()`).

    Attributes:
      hits: acquires that found the adapter resident and written.
      misses: acquires that had to wait for a page-in (scheduled now or already under way).
      page_ins: slot writes issued by `commit` (prefetches included).
      prefetches: page-ins scheduled by `prefetch` rather than by a request.
      evictions: resident adapters pushed out of their slot to make room for another (or, in a
        unified bank, for sequences' KV pages).
      reclaimed: of those, the idle adapters a unified bank gave up for sequences' KV pages.
      bytes_moved: host->device bytes of all page-ins.
      page_in_seconds: per page-in, from scheduling to the commit that issued its write (what a
        request waits before its slot is usable, ignoring the copy itself, which overlaps the step).
      transfer_seconds: per page-in, the copy and write themselves; only filled when the pager
        was built with `time_transfers=True` (it blocks, so it is for benchmarks).
      timed_bytes, timed_seconds: totals over the timed page-ins, for the achieved GB/s.
      device_page_in: every `page_in_seconds` sample, as a histogram (host -> device tier).
      host_load: per `register`, the seconds to read, validate and store an adapter in host memory
        (disk -> host tier).
    """

    hits: int = 0
    misses: int = 0
    page_ins: int = 0
    prefetches: int = 0
    evictions: int = 0
    reclaimed: int = 0
    bytes_moved: int = 0
    page_in_seconds: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_LATENCY_SAMPLES)
    )
    transfer_seconds: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_LATENCY_SAMPLES)
    )
    timed_bytes: int = 0
    timed_seconds: float = 0.0
    device_page_in: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)
    host_load: LatencyHistogram = dataclasses.field(default_factory=LatencyHistogram)

    def observe_page_in(self, seconds: float) -> None:
        self.page_in_seconds.append(seconds)
        self.device_page_in.observe(seconds)

    def counters(self) -> dict[str, int]:
        """The counters alone: cheap enough to read every step (no latency samples copied)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "page_ins": self.page_ins,
            "prefetches": self.prefetches,
            "evictions": self.evictions,
            "reclaimed": self.reclaimed,
            "bytes_moved": self.bytes_moved,
        }

    def snapshot(self) -> dict[str, float | int]:
        """A flat copy: counters plus p50/p99 latencies in milliseconds (NaN with no samples)."""
        out: dict[str, float | int] = dict(self.counters())
        for field, samples in (("page_in", self.page_in_seconds), ("transfer", self.transfer_seconds)):
            for q in (50, 99):
                out[f"{field}_ms_p{q}"] = float(np.percentile(samples, q) * 1e3) if samples else float("nan")
        out["transfer_GBps"] = self.timed_bytes / self.timed_seconds / 1e9 if self.timed_seconds else float("nan")
        return out
