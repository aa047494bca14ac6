"""The pager of a paged bank (`lora.bank: paged`): adapters at their true rank, in pages of one pool
per rank-row width (`jaxlora.lora.paged_bank`).

The protocol is `Pager`'s (acquire / release / prefetch / stage / commit, the step order of
`jaxlora.engine.engine`); what differs is what a slot costs. A slot is now a row of the page
tables, cheap, and the device bytes an adapter holds are the pages of its true ranks
(`jaxlora.lora.paged_bank`). So a page-in needs a slot AND its pages:

    _schedule(name)   a slot (free, or the LRU unpinned resident's), then pages in EVERY pool it
                      needs: while some pool has too few free, the least recently used unpinned
                      resident holding pages in such a pool is evicted (all its pages freed, its
                      slot reset); residents only in pools with room are left alone. Pinned
                      adapters are never evicted, nor adapters the same prefetch is paging in, so
                      a step never loses what it is about to read. If the unpinned residents
                      cannot free enough pages in every pool, the page-in waits (FIFO) as it does
                      for a slot, and takes nothing.
    stage()           per queued page-in and pool, ONE host->device copy of its pages (its host
                      copy at true rank, padded to a compiled page count) starts
    commit()          per staged page-in, in issue order: one jitted write per pool it has pages
                      in, then one of its page-table rows and ranks into its slot
                      (`paged_bank.write_adapter`)

Pages freed by an eviction may be rewritten while the step in flight runs: no row of that step
reads them (the evicted adapter was unpinned), and the write consumes the pool that step reads,
so JAX orders it after the step.

Host copies are the adapter's pages at true rank (no rank classes), one numpy (pageable) buffer per
adapter holding its pages of every pool. Each pool has its own `PageAllocator`; page ids are per pool.
Not supported here (the padded `Pager` has them): tensor parallelism (`place_on`), pinned host
memory and `time_transfers`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.adapters.metrics import PagerMetrics
from jaxlora.adapters.page_allocator import PageAllocator
from jaxlora.adapters.pager import _RESET, Pager
from jaxlora.adapters.registry import (
    RegisteredAdapter,
    Registry,
    adapter_identity,
    load_checked_adapter,
)
from jaxlora.adapters.slot_table import SlotTable, invariant
from jaxlora.config import LoraBank, LoraConfig, ModelConfig
from jaxlora.errors import AdapterError
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.paged_bank import (
    PagedState,
    adapter_pages,
    full_adapter_pages,
    init_paged_bank,
    model_view,
    module_ranks,
    num_pool_pages,
    pack_flat,
    padded_size,
    pages_nbytes,
    table_rows,
    write_adapter,
    write_sizes,
)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PagedAdapter(RegisteredAdapter):
    """A registered adapter of a paged bank: `flat` is one 1-D buffer holding its pages of every pool
    (`paged_bank.pack_flat`).

    Attributes:
      module_ranks: every target module's rank (0: untouched), which fixes its page-table rows.
      pages: {width: [n_w, P, w]} views of `flat`, its pages in pool w (every pool, maybe empty).
    """

    module_ranks: dict[str, int]
    pages: dict[int, np.ndarray]


class PagedPager(Pager):
    """`Pager` over a paged bank; see the module docstring.

    Args:
      model_config, lora_config: shapes of the bank (`lora_config.bank` must be "paged").
      host_capacity_bytes: budget for registered adapters in host memory; None = unbounded.
      dtype: the pool's dtype; host copies are kept in it.
      device: the device holding the pool (default: the first device).
      max_page_ins_per_commit: cap on page-ins issued by one `commit`.
      fill: the value free pages start with (tests use NaN: a stray read shows).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        lora_config: LoraConfig,
        *,
        host_capacity_bytes: int | None = None,
        dtype: jnp.dtype = jnp.float32,
        device: jax.Device | None = None,
        max_page_ins_per_commit: int = 16,
        fill: float = 0.0,
    ) -> None:
        # Not Pager.__init__: the padded bank's rank classes, flat layouts and slot writes do not apply.
        if lora_config.bank is not LoraBank.PAGED:
            raise ValueError(f"PagedPager needs lora.bank='paged', got {lora_config.bank.value!r}")
        if not isinstance(max_page_ins_per_commit, int) or max_page_ins_per_commit < 1:
            raise ValueError(f"{max_page_ins_per_commit=} must be an int >= 1")
        self.model_config, self.lora_config, self.dtype = model_config, lora_config, jnp.dtype(dtype)
        self.max_slots = lora_config.max_slots
        self.max_page_ins_per_commit = max_page_ins_per_commit
        self.time_transfers = False
        self.metrics = PagerMetrics()
        self.mesh = None
        # Bytes of one page of each pool, {width: bytes}; an adapter at max_rank on every module: the most.
        self.page_nbytes = {
            w: lora_config.page_rows * w * self.dtype.itemsize for w in full_adapter_pages(model_config, lora_config)
        }
        self.slot_nbytes = self._nbytes(full_adapter_pages(model_config, lora_config))
        self._sizes = write_sizes(model_config, lora_config)
        self._device = device or jax.devices()[0]
        self._device_sharding = jax.sharding.SingleDeviceSharding(self._device)

        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._registry = Registry(host_capacity_bytes)
        self._table = SlotTable(self.max_slots)
        self._allocators = {w: PageAllocator(n) for w, n in num_pool_pages(model_config, lora_config).items()}
        self._pages_of: dict[str, dict[int, np.ndarray]] = {}  # resident -> {pool width: its page ids, pack order}
        self._ready: set[str] = set()
        self._pending: dict[int, str | None] = {}
        self._scheduled_at: dict[str, float] = {}
        self._waiting: dict[str, None] = {}
        self._staged: list[tuple[int, str | None, tuple]] = []
        self._unregistering: set[str] = set()
        self.state: PagedState = jax.device_put(
            init_paged_bank(model_config, lora_config, self.dtype, fill=fill), self._device_sharding
        )
        self.warmup()

    def _nbytes(self, pages: dict[int, int]) -> int:
        """Bytes of {width: page count}."""
        return pages_nbytes(pages, self.lora_config.page_rows, self.dtype.itemsize)

    @property
    def bank(self) -> dict[str, dict]:
        """What the model reads (`paged_bank.model_view`); read afresh for every step."""
        return model_view(self.state, self.lora_config)

    def place_on(self, mesh: jax.sharding.Mesh) -> None:
        raise ValueError("the paged adapter bank runs on one device; use lora.bank='padded' with a mesh")

    # ---------------------------------------------------------------- registry
    def _prepare(self, name: str, source: str | Path | HostAdapter) -> PagedAdapter:
        model, lora = self.model_config, self.lora_config
        adapter = load_checked_adapter(name, source, model, lora)
        flat, pages = pack_flat(adapter.weights, model, lora, self.dtype)
        for w, p in pages.items():
            if len(p) > self._allocators[w].num_pages:
                raise AdapterError(
                    f"adapter {name!r} takes {len(p)} pages of the {w}-wide pool, which holds "
                    f"{self._allocators[w].num_pages} (raise lora.pool_pages)"
                )
        source_text = adapter.source if isinstance(source, HostAdapter) else str(source)
        return PagedAdapter(
            name=name,
            rank=adapter.rank,
            target_modules=adapter.target_modules,
            source=source_text or "<memory>",
            flat=flat,
            layout=None,
            max_rank=lora.max_rank,
            nbytes=flat.nbytes,
            identity=adapter_identity(flat),
            module_ranks=module_ranks(adapter.weights, lora),
            pages=pages,
        )

    def host_nbytes(self, rank: int) -> int:
        """Host bytes of a registered adapter of `rank` on every target module (its true-rank pages)."""
        ranks = {m: rank for m in self.lora_config.target_modules}
        return self._nbytes(adapter_pages(ranks, self.model_config, self.lora_config))

    def _bytes_estimate(self, source: str | Path | HostAdapter) -> int:
        if isinstance(source, HostAdapter) and source.rank <= self.lora_config.max_rank:
            ranks = module_ranks(source.weights, self.lora_config)
            return self._nbytes(adapter_pages(ranks, self.model_config, self.lora_config))
        return self.slot_nbytes

    def host_entries(self, name: str):
        raise NotImplementedError("a paged bank keeps pages, not slot entries: read host_adapter(name).flat")

    # ---------------------------------------------------------------- device memory, for tests and metrics
    def device_nbytes(self, name: str) -> int:
        """Pool bytes the resident adapter `name` holds, all pools (0 when it is not resident)."""
        with self._lock:
            return self._nbytes({w: len(ids) for w, ids in self._pages_of.get(name, {}).items()})

    def pool_usage(self) -> dict:
        """Pages of the pools, summed (pages: total, adapter_pages: held by adapters, free_pages) and
        as bytes (bytes, adapter_bytes), with the same per pool under "pools" {width: {...}}."""
        with self._lock:
            pools = {
                w: {"pages": a.num_pages, "adapter_pages": a.num_taken, "free_pages": a.num_free}
                for w, a in self._allocators.items()
            }
        usage = {key: sum(p[key] for p in pools.values()) for key in ("pages", "adapter_pages", "free_pages")}
        usage["bytes"] = self._nbytes({w: p["pages"] for w, p in pools.items()})
        usage["adapter_bytes"] = self._nbytes({w: p["adapter_pages"] for w, p in pools.items()})
        return {**usage, "pools": pools}

    def can_place(self, name: str) -> bool:
        with self._lock:
            if self._table.slot_of(name) is not None:
                return True
            return not self._waiting and self._table.can_assign() and self._can_fit(name)

    def check(self) -> None:
        with self._lock:
            self._table.check()
            resident = self._table.resident()
            invariant(set(self._pages_of) == set(resident), "pages and slots disagree on who is resident")
            for w, allocator in self._allocators.items():
                allocator.check()
                owned = [int(p) for pages in self._pages_of.values() for p in pages.get(w, ())]
                invariant(len(owned) == len(set(owned)) == allocator.num_taken, f"a page of pool {w} has two owners")
            for name, pages in self._pages_of.items():
                adapter = self._registry.get(name)
                held = {w: len(pages.get(w, ())) for w in self._allocators}
                invariant(
                    adapter is None or held == {w: len(p) for w, p in adapter.pages.items()},
                    f"{name!r} holds pages {held} for an adapter of {adapter and adapter.pages.keys()}",
                )
            invariant(self._ready <= set(resident), "a ready adapter has no slot")
            invariant(not self._ready & {n for n in self._pending.values() if n}, "ready and pending at once")
            invariant(all(self._table.name_in(s) == n for s, n in self._pending.items() if n), "stale write")
            invariant(all(self._table.refcount(n) > 0 and n not in resident for n in self._waiting), "bad wait")
            head = next(iter(self._waiting), None)
            invariant(head is None or not self._can_schedule(head), "a waiting adapter could have been placed")

    # ---------------------------------------------------------------- scheduling (lock held)
    def _needed(self, name: str) -> dict[int, int] | None:
        """Pages `name` takes in each pool; None once it is unregistered (a waiting request may still
        name it: its `acquire` raises UnknownAdapterError, the answer the scheduler expects)."""
        adapter = self._registry.get(name)
        return None if adapter is None else {w: len(p) for w, p in adapter.pages.items()}

    def _can_fit(self, name: str, exclude: Iterable[str] = ()) -> bool:
        """Whether, in every pool, free pages plus those of evictable residents cover `name`'s pages."""
        exclude = set(exclude) | {name}
        needed = self._needed(name)
        if needed is None:
            return True
        evictable = [ids for n, ids in self._pages_of.items() if n not in exclude and not self._table.is_pinned(n)]
        return all(
            allocator.num_free + sum(len(ids.get(w, ())) for ids in evictable) >= needed[w]
            for w, allocator in self._allocators.items()
        )

    def _can_schedule(self, name: str, exclude: Iterable[str] = ()) -> bool:
        return self._table.can_assign(exclude) and self._can_fit(name, exclude)

    def _schedule(self, name: str, *, may_wait: bool, exclude: Iterable[str] = ()) -> bool:
        exclude = set(exclude)
        if not self._can_schedule(name, exclude):
            if may_wait:
                self._waiting[name] = None
            return False
        slot, evicted = self._table.assign(name, exclude)
        if evicted is not None:
            self._forget(evicted)
        needed = self._needed(name)
        while short := {w for w, a in self._allocators.items() if a.num_free < needed[w]}:
            # Only a resident with pages in a short pool helps; `_can_fit` promised enough of them.
            idle = {n for n, ids in self._pages_of.items() if not any(len(ids.get(w, ())) for w in short)}
            self._evict(self._table.victim(exclude | idle | {name}))
        self._pages_of[name] = {w: a.allocate(needed[w]) for w, a in self._allocators.items() if needed[w]}
        self._queue_write(slot, name)
        self._scheduled_at[name] = time.perf_counter()
        return True

    def _evict(self, name: str) -> None:
        """Takes an unpinned resident out: its slot is reset at the next commit, its pages freed."""
        self._queue_write(self._table.free(name), _RESET)
        self._forget(name)

    def _forget(self, name: str) -> None:
        """Bookkeeping of an evicted adapter: its pages go back to the pool."""
        self._ready.discard(name)
        self._scheduled_at.pop(name, None)
        self._free_pages(name)
        self.metrics.evictions += 1

    def _free_pages(self, name: str) -> None:
        for w, ids in self._pages_of.pop(name).items():
            self._allocators[w].free(ids)

    def _free_slot(self, name: str) -> int | None:
        slot = self._table.free(name)
        if name in self._pages_of:
            self._free_pages(name)
        return slot

    def _serve_waiting(self) -> None:
        while self._waiting:
            name = next(iter(self._waiting))
            if not self._can_schedule(name):
                return
            del self._waiting[name]
            self._schedule(name, may_wait=True)

    # ---------------------------------------------------------------- device work (engine thread)
    def _write_args(self, slot: int, name: str | None) -> tuple:
        """Host arguments of one `write_adapter` call: (slot, page ids {w: [n_w]}, pages {w: [n_w, P, w]},
        rows, ranks), only the pools it has pages in; a reset (name None) has no pages and rank 0
        everywhere."""
        lora = self.lora_config
        if name is None:
            ranks, ids, pages = {m: 0 for m in lora.target_modules}, {}, {}
        else:
            adapter = self._registry.get(name)
            ranks, ids = adapter.module_ranks, self._pages_of[name]
            pages = {w: adapter.pages[w] for w in ids}
        return slot, ids, pages, table_rows(ranks, ids, self.model_config, lora), ranks

    def _to_device(self, args: tuple) -> tuple:
        """Pads each pool's pages to a compiled count (padding ids past the pool: dropped) and starts
        their copies."""
        slot, ids, pages, rows, ranks = args
        padded_ids, padded_pages = {}, {}
        for w, pool_ids in ids.items():
            size = padded_size(max(len(pool_ids), 1), self._sizes[w])
            padded_ids[w] = np.full((size,), self._allocators[w].num_pages, np.int32)
            padded_ids[w][: len(pool_ids)] = pool_ids
            padded = np.zeros((size, *pages[w].shape[1:]), pages[w].dtype)
            padded[: len(pages[w])] = pages[w]
            padded_pages[w] = jax.device_put(padded, self._device_sharding)
        return np.int32(slot), padded_ids, padded_pages, rows, {m: np.int32(r) for m, r in ranks.items()}

    def _stage(self) -> None:
        with self._lock:
            self._serve_waiting()
            ops = self._take_pending(self.max_page_ins_per_commit - len(self._staged))
            args = [(slot, name, self._write_args(slot, name)) for slot, name, _ in ops]
        self._staged += [(slot, name, self._to_device(a)) for slot, name, a in args]

    def _write_staged(self) -> None:
        """The staged writes in issue order (a later write to the same pages or slot wins)."""
        staged, self._staged = self._staged, []
        for _, _, args in staged:
            self.state = write_adapter(self.state, *args)
        with self._lock:
            self._finish_writes([(slot, name) for slot, name, _ in staged], None)

    def warmup(self) -> None:
        """Compiles the writes at every padded page count of every pool through the page-in path;
        the warm-up writes go to a slot past the tables and pages past the pools, so they change
        nothing."""
        lora = self.lora_config
        ranks = {m: 0 for m in lora.target_modules}
        rows = table_rows(ranks, {}, self.model_config, lora)
        for w, sizes in self._sizes.items():
            for size in sizes:
                ids = {w: np.full((size,), self._allocators[w].num_pages, np.int32)}  # past the pool
                pages = {w: np.zeros((size, lora.page_rows, w), self.dtype)}
                self.state = write_adapter(self.state, *self._to_device((self.max_slots, ids, pages, rows, ranks)))
        jax.block_until_ready(self.state)
