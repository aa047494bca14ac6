"""Registering many adapters at once (start-up's --adapter flags): from a few threads.

One PEFT registration is file reads, a float32 fold, a pack into the rank class's layout and a
hash, mostly numpy work that releases the GIL; one after another they made thousands of adapters
the longest part of a server's start. Threads overlap them (`Pager.register` is thread-safe).
Measured in benchmarks/DECISIONS.md#register-threads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from jaxlora.adapters.pager import AdapterInfo
from jaxlora.adapters.source import AdapterSource
from jaxlora.lora.host_adapter import HostAdapter

log = logging.getLogger(__name__)

MAX_THREADS = 8  # past this the copies are bound by memory bandwidth, not cores


def default_threads() -> int:
    """The threads `register_many` uses by default: one per core the process may use, at most
    MAX_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def register_many(
    pager: AdapterSource, adapters: Mapping[str, str | Path | HostAdapter], *, threads: int | None = None
) -> dict[str, AdapterInfo]:
    """Registers every adapter of `adapters` (name -> PEFT folder or HostAdapter) with `pager`, from
    `threads` threads (default `default_threads()`); returns name -> its AdapterInfo, in the
    mapping's order.

    Every registration runs to its end, then the first failure in the mapping's order is raised
    (AdapterError, CapacityError, ...): the same error a one-by-one loop would raise, whichever
    thread met it first. The adapters registered before it stay registered.
    """
    items = list(adapters.items())
    threads = min(threads or default_threads(), max(len(items), 1))
    start = time.perf_counter()
    if threads == 1:
        infos = {name: _register(pager, name, source) for name, source in items}
    else:
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="register") as pool:
            futures = [pool.submit(_register, pager, name, source) for name, source in items]
            concurrent.futures.wait(futures)
        infos = {name: future.result() for (name, _), future in zip(items, futures, strict=True)}
    if items:  # one line for thousands of adapters; each one's source is logged at DEBUG
        log.info("registered %d adapter(s) in %.1f s on %d thread(s)", len(items), time.perf_counter() - start, threads)
    return infos


def _register(pager: AdapterSource, name: str, source: str | Path | HostAdapter) -> AdapterInfo:
    info = pager.register(name, source)
    log.debug("registered adapter %r from %s", name, source.source if isinstance(source, HostAdapter) else source)
    return info
