"""The pager of a paged bank (`lora.bank: paged`): adapters at their true rank, pages of one pool.

The protocol is `Pager`'s (acquire / release / prefetch / stage / commit, the step order of
`jaxlora.engine.engine`); what differs is what a slot costs. A slot is now a row of the page
tables, cheap, and the device bytes an adapter holds are the pages of its true ranks
(`jaxlora.lora.paged_bank`). So a page-in needs a slot AND its pages:

    _schedule(name)   a slot (free, or the LRU unpinned resident's), then pages: while too few are
                      free, the least recently used unpinned resident is evicted (its pages freed,
                      its slot reset). Pinned adapters are never evicted, nor adapters the same
                      prefetch is paging in, so a step never loses what it is about to read. If
                      the unpinned residents cannot free enough pages, the page-in waits (FIFO) as
                      it does for a slot.
    stage()           per queued page-in, ONE host->device copy of its pages (its host copy at
                      true rank, padded to a compiled page count) starts
    commit()          one jitted write per staged page-in, in issue order: its pages into the
                      pool, its page-table rows and ranks into its slot (`paged_bank.write_adapter`)

Pages freed by an eviction may be rewritten while the step in flight runs: no row of that step
reads them (the evicted adapter was unpinned), and the write consumes the pool that step reads,
so JAX orders it after the step.

Host copies are the adapter's pages at true rank (no rank classes), in numpy (pageable) memory.
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
    check_host_adapter,
    load_host_adapter,
)
from jaxlora.adapters.slot_table import SlotTable, invariant
from jaxlora.config import LoraBank, LoraConfig, ModelConfig
from jaxlora.errors import AdapterError
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.paged_bank import (
    PagedState,
    adapter_pages,
    init_paged_bank,
    model_view,
    module_ranks,
    num_pool_pages,
    pack_pages,
    padded_size,
    pool_width,
    table_rows,
    write_adapter,
    write_sizes,
)
from jaxlora.lora.validate import check_adapter_name


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PagedAdapter(RegisteredAdapter):
    """A registered adapter of a paged bank: `flat` holds its pages [n, P, W] (`paged_bank.pack_pages`).

    Attributes:
      module_ranks: every target module's rank (0: untouched), which fixes its page-table rows.
    """

    module_ranks: dict[str, int]


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
        self.page_nbytes = lora_config.page_rows * pool_width(model_config, lora_config) * self.dtype.itemsize
        full = {m: lora_config.max_rank for m in lora_config.target_modules}
        self.slot_nbytes = adapter_pages(full, model_config.num_layers, lora_config.page_rows) * self.page_nbytes
        self._sizes = write_sizes(model_config, lora_config)
        self._device = device or jax.devices()[0]
        self._device_sharding = jax.sharding.SingleDeviceSharding(self._device)

        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._registry = Registry(host_capacity_bytes)
        self._table = SlotTable(self.max_slots)
        self._allocator = PageAllocator(num_pool_pages(model_config, lora_config))
        self._pages_of: dict[str, np.ndarray] = {}  # resident adapter -> its page ids, in pack order
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

    @property
    def bank(self) -> dict[str, dict]:
        """What the model reads (`paged_bank.model_view`); read afresh for every step."""
        return model_view(self.state, self.lora_config)

    def place_on(self, mesh: jax.sharding.Mesh) -> None:
        raise ValueError("the paged adapter bank runs on one device; use lora.bank='padded' with a mesh")

    # ---------------------------------------------------------------- registry
    def _prepare(self, name: str, source: str | Path | HostAdapter) -> PagedAdapter:
        check_adapter_name(name)
        model, lora = self.model_config, self.lora_config
        adapter = load_host_adapter(name, source, model, lora)
        check_host_adapter(name, adapter, model, lora)
        pages = pack_pages(adapter.weights, model, lora, self.dtype)
        if len(pages) > self._allocator.num_pages:
            raise AdapterError(
                f"adapter {name!r} takes {len(pages)} pages; the pool holds {self._allocator.num_pages} "
                "(raise lora.pool_pages)"
            )
        source_text = adapter.source if isinstance(source, HostAdapter) else str(source)
        return PagedAdapter(
            name=name,
            rank=adapter.rank,
            target_modules=adapter.target_modules,
            source=source_text or "<memory>",
            flat=pages,
            layout=None,
            max_rank=lora.max_rank,
            nbytes=pages.nbytes,
            identity=adapter_identity(pages),
            module_ranks=module_ranks(adapter.weights, lora),
        )

    def host_nbytes(self, rank: int) -> int:
        """Host bytes of a registered adapter of `rank` on every target module (its true-rank pages)."""
        ranks = {m: rank for m in self.lora_config.target_modules}
        return adapter_pages(ranks, self.model_config.num_layers, self.lora_config.page_rows) * self.page_nbytes

    def _bytes_estimate(self, source: str | Path | HostAdapter) -> int:
        if isinstance(source, HostAdapter) and source.rank <= self.lora_config.max_rank:
            ranks = module_ranks(source.weights, self.lora_config)
            return adapter_pages(ranks, self.model_config.num_layers, self.lora_config.page_rows) * self.page_nbytes
        return self.slot_nbytes

    def host_entries(self, name: str):
        raise NotImplementedError("a paged bank keeps pages, not slot entries: read host_adapter(name).flat")

    # ---------------------------------------------------------------- device memory, for tests and metrics
    def device_nbytes(self, name: str) -> int:
        """Pool bytes the resident adapter `name` holds (0 when it is not resident)."""
        with self._lock:
            return len(self._pages_of.get(name, ())) * self.page_nbytes

    def pool_usage(self) -> dict[str, int]:
        """Pages of the pool: total, held by adapters, free."""
        with self._lock:
            return {
                "pages": self._allocator.num_pages,
                "adapter_pages": self._allocator.num_taken,
                "free_pages": self._allocator.num_free,
            }

    def can_place(self, name: str) -> bool:
        with self._lock:
            if self._table.slot_of(name) is not None:
                return True
            return not self._waiting and self._table.can_assign() and self._can_fit(name)

    def check(self) -> None:
        with self._lock:
            self._table.check()
            self._allocator.check()
            resident = self._table.resident()
            invariant(set(self._pages_of) == set(resident), "pages and slots disagree on who is resident")
            owned = [int(p) for ids in self._pages_of.values() for p in ids]
            invariant(len(owned) == len(set(owned)) == self._allocator.num_taken, "a page has two owners")
            invariant(self._ready <= set(resident), "a ready adapter has no slot")
            invariant(not self._ready & {n for n in self._pending.values() if n}, "ready and pending at once")
            invariant(all(self._table.name_in(s) == n for s, n in self._pending.items() if n), "stale write")
            invariant(all(self._table.refcount(n) > 0 and n not in resident for n in self._waiting), "bad wait")
            head = next(iter(self._waiting), None)
            invariant(head is None or not self._can_schedule(head), "a waiting adapter could have been placed")

    # ---------------------------------------------------------------- scheduling (lock held)
    def _needed(self, name: str) -> int | None:
        """Pages `name` takes; None once it is unregistered (a waiting request may still name it:
        its `acquire` raises UnknownAdapterError, the answer the scheduler expects)."""
        adapter = self._registry.get(name)
        return None if adapter is None else len(adapter.flat)

    def _can_fit(self, name: str, exclude: Iterable[str] = ()) -> bool:
        """Whether free pages plus those of evictable residents cover `name`'s pages."""
        exclude = set(exclude) | {name}
        evictable = sum(
            len(ids) for n, ids in self._pages_of.items() if n not in exclude and not self._table.is_pinned(n)
        )
        needed = self._needed(name)
        return needed is None or self._allocator.num_free + evictable >= needed

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
        while self._allocator.num_free < self._needed(name):
            victim = self._table.victim(exclude | {name})
            self._queue_write(self._table.free(victim), _RESET)
            self._forget(victim)
        self._pages_of[name] = self._allocator.allocate(self._needed(name))
        self._queue_write(slot, name)
        self._scheduled_at[name] = time.perf_counter()
        return True

    def _forget(self, name: str) -> None:
        """Bookkeeping of an evicted adapter: its pages go back to the pool."""
        self._ready.discard(name)
        self._scheduled_at.pop(name, None)
        self._allocator.free(self._pages_of.pop(name))
        self.metrics.evictions += 1

    def _free_slot(self, name: str) -> int | None:
        slot = self._table.free(name)
        if name in self._pages_of:
            self._allocator.free(self._pages_of.pop(name))
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
        """Host arguments of one `write_adapter` call: (slot, page ids [n], pages [n, P, W], rows,
        ranks); a reset (name None) has no pages and rank 0 everywhere."""
        lora, L = self.lora_config, self.model_config.num_layers
        if name is None:
            ranks = {m: 0 for m in lora.target_modules}
            ids = np.zeros((0,), np.int32)
            pages = np.zeros((0, *self.state["pool"].shape[1:]), self.dtype)
        else:
            adapter = self._registry.get(name)
            ranks, ids, pages = adapter.module_ranks, self._pages_of[name], adapter.flat
        return slot, ids, pages, table_rows(ranks, ids, L, lora), ranks

    def _to_device(self, args: tuple) -> tuple:
        """Pads the pages to a compiled count (padding ids past the pool: dropped) and starts their copy."""
        slot, ids, pages, rows, ranks = args
        size = padded_size(max(len(ids), 1), self._sizes)
        padded_ids = np.full((size,), self._allocator.num_pages, np.int32)
        padded_ids[: len(ids)] = ids
        padded = np.zeros((size, *pages.shape[1:]), pages.dtype)
        padded[: len(pages)] = pages
        return (
            np.int32(slot),
            padded_ids,
            jax.device_put(padded, self._device_sharding),
            rows,
            {m: np.int32(r) for m, r in ranks.items()},
        )

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
        """Compiles the write at every padded page count through the page-in path; the warm-up
        writes go to a slot past the tables and pages past the pool, so they change nothing."""
        lora = self.lora_config
        ranks = {m: 0 for m in lora.target_modules}
        rows = table_rows(ranks, np.zeros((0,), np.int32), self.model_config.num_layers, lora)
        for size in self._sizes:
            ids = np.full((size,), self._allocator.num_pages, np.int32)  # every page past the pool
            pages = np.zeros((size, *self.state["pool"].shape[1:]), self.dtype)
            self.state = write_adapter(self.state, *self._to_device((self.max_slots, ids, pages, rows, ranks)))
        jax.block_until_ready(self.state)
