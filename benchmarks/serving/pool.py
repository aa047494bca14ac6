"""The serving rows' pool column: which share of the engine's adapter + KV device memory adapters
and KV pages held over a run, sampled while it runs.

    memory   = the adapter bank's bytes + the KV page pool's bytes (a unified bank has no bytes of
               its own: its adapters live in the KV pool, so memory is the KV pool's bytes)
    adapters = bytes of the resident adapters: a padded bank's resident slots x its slot bytes (every
               slot at max rank), a paged bank's pages held (true rank, each pool's pages at its own
               width), a unified bank's KV pages held
    kv       = KV pages held by sequences or cached prefixes x the bytes of a page

With the padded and paged banks the two pools are separate device arrays, so the shares say how
much of each pool the traffic used; with the unified bank they are one pool, and the shares say how
memory moved between adapters and KV.
"""

from __future__ import annotations

import threading

import jax

from jaxlora.adapters import PagedPager, UnifiedPager
from jaxlora.engine.engine import Engine


def _nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


class PoolSampler:
    """Samples the shares every `interval_s` seconds on its own thread, from `start` to `stop`."""

    def __init__(self, engine: Engine, interval_s: float = 0.1) -> None:
        self.engine, self.interval_s = engine, interval_s
        pager = engine.pager
        self.kv_bytes = _nbytes(engine.runner.kv)
        self.page_bytes = self.kv_bytes / engine.pages.num_pages
        if isinstance(pager, UnifiedPager):
            self.adapter_bytes = 0  # its adapters' pages are the KV pool's
        elif isinstance(pager, PagedPager):
            self.adapter_bytes = pager.pool_usage()["bytes"]  # every pool (one per rank-row width)
        else:
            self.adapter_bytes = _nbytes(pager.bank) if pager is not None else 0
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def adapter_held(self) -> float:
        """Bytes of the adapters resident now."""
        pager = self.engine.pager
        if pager is None:
            return 0.0
        if isinstance(pager, PagedPager):
            return pager.pool_usage()["adapter_bytes"]
        return len(pager.snapshot()["resident"]) * self.adapter_bytes / pager.max_slots

    def sample(self) -> tuple[float, float]:
        """(adapter share, KV share) of the memory now."""
        pages = self.engine.pages
        # Free or cached pages are takeable; what is neither is held by sequences or by adapters.
        kv_held = (pages.num_pages - pages.num_takeable - pages.num_owned) * self.page_bytes
        total = self.adapter_bytes + self.kv_bytes
        return self.adapter_held() / total, kv_held / total

    def start(self) -> None:
        self._samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pool-sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._samples.append(self.sample())

    def stop(self) -> dict[str, float | None]:
        """The row's pool fields: mean shares over the samples (None when none was taken)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        samples = self._samples or [self.sample()]
        n = len(samples)
        return {
            "pool_adapter_share": round(sum(a for a, _ in samples) / n, 4),
            "pool_kv_share": round(sum(k for _, k in samples) / n, 4),
            "pool_adapter_bytes": int(self.adapter_bytes),
            "pool_kv_bytes": int(self.kv_bytes),
        }
