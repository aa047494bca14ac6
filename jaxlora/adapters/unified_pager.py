"""The pager of a unified bank (`lora.bank: unified`): S-LoRA's unified pool. Adapters at their true
rank live in the KV cache's own pages (`jaxlora.lora.unified_layout`), taken from and given back to
the one allocator sequences use (`jaxlora.engine.kv_pages.PageTable`).

The protocol is `Pager`'s (acquire / release / prefetch / stage / commit, the step order of
`jaxlora.engine.engine`); slots and waiting are `PagedPager`'s. What differs is where the pages come
from and who may take them back. The engine attaches the pager to its runner and page table
(`attach`) before anything pages in.

Policy (documented in the README; it cannot thrash and never takes what a step reads):

    an adapter's page-in  takes free pages, then cached prefix pages (LRU), then evicts idle
                          adapters (LRU). It never takes a sequence's page and leaves the
                          scheduler's reserve (pages running sequences grow into) alone; short of
                          pages it waits (FIFO), taking nothing. Pinned adapters never hold so
                          many pages that one max_seq_len sequence and the reserve would not fit
                          beside them: a request whose adapter is placed can always be admitted
                          once running sequences end (an adapter larger than that is refused at
                          registration).
    a sequence's growth   takes free pages, then cached prefix pages, then idle adapters' pages
                          (`reclaim`: the LRU idle adapter is evicted whole), then preempts the
                          newest sequence (the scheduler's rule).
    idle                  resident, unpinned, and not among the adapters the last prefetch named
                          (the waiting requests' next ones): a pinned adapter is read by a row of
                          the step, and a prefetched one is about to be, so neither is ever taken.

Device writes go into the runner's KV pool (`runner.kv`, donated) and the slot tables: a page-in
is one `write_adapter_pages` call per run of its pages and one `write_slot`. The host copy is kept
cut into those runs, each of a compiled page count (`paged_bank.page_runs`) and each in pinned_host
memory on accelerators, so a page-in copies nothing on the host: each run's transfer is a DMA that
the engine thread only starts (padding a run to a compiled count at page-in cost a host copy of the
whole adapter on the engine thread before every dispatch: benchmarks/DECISIONS.md#unified-host-runs).
A staged page-in whose adapter was evicted before the commit is dropped, so no stale write can land
on pages a sequence took in between (a step writes its KV before the commit that follows it).

Threads: as `Pager`, the engine loop calls acquire/release/prefetch/stage/commit and may reach the
page table; `unregister` runs on API threads, so the pages it frees are handed back, and waiting
page-ins served, on the engine thread at the next `stage`. One device only.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlora.adapters.metrics import PagerMetrics
from jaxlora.adapters.paged_pager import PagedPager
from jaxlora.adapters.registry import (
    HostMemory,
    RegisteredAdapter,
    Registry,
    adapter_identity,
    host_sharding,
    load_checked_adapter,
)
from jaxlora.adapters.slot_table import SlotTable, invariant
from jaxlora.config import LoraBank, LoraConfig, ModelConfig
from jaxlora.errors import AdapterError
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.paged_bank import module_ranks, page_counts, page_runs
from jaxlora.lora.unified_bank import Tables, init_unified_tables, model_view, slot_rows, write_slot
from jaxlora.lora.unified_layout import (
    UnifiedLayout,
    adapter_layout,
    adapter_nbytes,
    max_adapter_pages,
    pack_run,
    segment_elems,
    write_adapter_pages,
)

# The engine's runner (its `kv` pool, `config.page_size`) and its `jaxlora.engine.kv_pages.PageTable`:
# typed loosely, as jaxlora.engine imports this package and not the other way round.
Runner = Any
PageTable = Any


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class UnifiedAdapter(RegisteredAdapter):
    """A registered adapter of a unified bank: `flat` is its pages as the KV pool holds them
    (`unified_layout.pack_run`, at true rank), cut along the page axis into runs of compiled page
    counts (`paged_bank.page_runs`): a tuple of [L, run, 2, page_size, kv_heads, head_dim] arrays in
    page order, numpy or in pinned_host memory (where registered adapters live)."""

    flat: tuple[np.ndarray | jax.Array, ...]
    unified: UnifiedLayout

    def pages(self) -> np.ndarray:
        """All its pages, [L, num_pages, 2, page_size, kv_heads, head_dim], as one numpy array."""
        return np.concatenate([np.asarray(run) for run in self.flat], axis=1)


class UnifiedPager(PagedPager):
    """`Pager` over a unified bank; see the module docstring.

    Args:
      model_config, lora_config: shapes (`lora_config.bank` must be "unified").
      page_size: positions per KV page (the engine's `page_size`).
      host_capacity_bytes: budget for registered adapters in host memory; None = unbounded.
      dtype: the KV pool's dtype; host copies are kept in it.
      max_page_ins_per_commit: cap on page-ins issued by one `commit`.
      host_memory: where host copies live (`HostMemory`; pinned_host on accelerators by default), as
        `Pager`'s.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        lora_config: LoraConfig,
        *,
        page_size: int,
        host_capacity_bytes: int | None = None,
        dtype: jnp.dtype = jnp.float32,
        max_page_ins_per_commit: int = 16,
        host_memory: HostMemory | str = HostMemory.AUTO,
    ) -> None:
        # Not PagedPager.__init__: there are no pools of its own; the KV pool is the runner's.
        if lora_config.bank is not LoraBank.UNIFIED:
            raise ValueError(f"UnifiedPager needs lora.bank='unified', got {lora_config.bank.value!r}")
        if not isinstance(max_page_ins_per_commit, int) or max_page_ins_per_commit < 1:
            raise ValueError(f"{max_page_ins_per_commit=} must be an int >= 1")
        self.model_config, self.lora_config, self.dtype = model_config, lora_config, jnp.dtype(dtype)
        self.page_size = page_size
        self.max_slots = lora_config.max_slots
        self.max_page_ins_per_commit = max_page_ins_per_commit
        self.time_transfers = False
        self.metrics = PagerMetrics()
        self.mesh = None
        self.max_pages = max_adapter_pages(model_config, lora_config, page_size)
        # One KV page across every layer, K and V: what an adapter's page costs.
        self.page_nbytes = 2 * segment_elems(model_config, page_size) * model_config.num_layers * self.dtype.itemsize
        self.slot_nbytes = self.max_pages * self.page_nbytes
        self._sizes = page_counts(self.max_pages)
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._registry = Registry(host_capacity_bytes)
        self._table = SlotTable(self.max_slots)
        self._pages_of: dict[str, np.ndarray] = {}  # resident -> its KV page ids, run order
        self._owner_of: dict[str, str] = {}  # resident -> its owner key in the page table
        self._owners = itertools.count()
        self._owned_pages = 0  # pages held by residents (read by metrics threads without the page table)
        self._dead_owners: list[str] = []  # unregistered on an API thread: given back at the next stage
        self._local = threading.local()  # `deferring`: on an API thread, leave the page table alone
        self._protected: set[str] = set()  # the last prefetch's adapters: never reclaimed by sequences
        self._ready: set[str] = set()
        self._pending: dict[int, str | None] = {}
        self._scheduled_at: dict[str, float] = {}
        self._waiting: dict[str, None] = {}
        self._staged: list[tuple[int, str | None, tuple]] = []
        self._unregistering: set[str] = set()
        self._device = jax.devices()[0]
        self._device_sharding = jax.sharding.SingleDeviceSharding(self._device)
        self._host_sharding = host_sharding(self._device, HostMemory(host_memory))
        self.state: Tables = jax.device_put(init_unified_tables(lora_config, self.max_pages), self._device_sharding)
        self._runner: Runner | None = None
        self._kv: PageTable | None = None
        self._reserve = 0
        self._room = 0  # pages pinned adapters leave to sequences: the reserve and one max_seq_len

    # ---------------------------------------------------------------- the engine's pool
    def attach(self, runner: Runner, pages: PageTable, *, reserve: int) -> None:
        """Reads and writes `runner.kv` and takes pages from `pages`, leaving `reserve` of them to the
        running sequences; lets sequences reclaim idle adapters' pages. Once, before any page-in."""
        if self._kv is not None:
            raise RuntimeError("this unified pager is attached to an engine already")
        if runner.kv.k.dtype != self.dtype:
            raise ValueError(f"the KV pool is {runner.kv.k.dtype}, the unified bank {self.dtype}: use one dtype")
        if runner.config.page_size != self.page_size:
            raise ValueError(
                f"the KV pool's pages hold {runner.config.page_size} positions, the pager's {self.page_size}"
            )
        room = reserve + runner.pages_per_seq  # never pinned by adapters (module doc)
        with self._lock:
            names = self._registry.names()
            too_big = [n for n in names if self._registry.get(n).unified.num_pages > pages.num_pages - room]
            if not too_big:
                self._runner, self._kv = runner, pages
                self._reserve = reserve  # kept free at a page-in, for running sequences to grow into
                self._room = room
        if too_big:
            raise AdapterError(
                f"adapters {too_big} take more than the {pages.num_pages - room} KV pages the pool can give an "
                "adapter beside one max_seq_len sequence (raise num_pages or kv_memory_fraction)"
            )
        pages.set_reclaimer(self)

    def _fits_pool(self, adapter: UnifiedAdapter) -> bool:
        return self._kv is None or adapter.unified.num_pages <= self._kv.num_pages - self._room

    def pool_lost(self) -> None:
        """The runner's KV pool was replaced (a failed step): adapters in use are written again before
        any step reads them; idle ones are evicted. Engine thread."""
        with self._lock:
            for name in list(self._pages_of):
                slot = self._table.slot_of(name)
                self._ready.discard(name)
                if self._table.is_pinned(name):
                    self._queue_write(slot, name)
                    self._scheduled_at[name] = time.perf_counter()
                else:
                    self._evict(name)

    @property
    def bank(self) -> dict:
        """What the model reads (`unified_bank.model_view`); read afresh for every step."""
        return model_view(self.state, self.lora_config)

    # ---------------------------------------------------------------- registry
    def _prepare(self, name: str, source: str | Path | HostAdapter) -> UnifiedAdapter:
        model, lora = self.model_config, self.lora_config
        adapter = load_checked_adapter(name, source, model, lora)
        layout = adapter_layout(module_ranks(adapter.weights, lora), model, lora, self.page_size)
        packed = pack_run(adapter.weights, layout, model, self.page_size, self.dtype)
        made = UnifiedAdapter(
            name=name,
            rank=adapter.rank,
            target_modules=adapter.target_modules,
            source=(adapter.source if isinstance(source, HostAdapter) else str(source)) or "<memory>",
            flat=self._host_runs(packed),
            layout=None,
            max_rank=lora.max_rank,
            nbytes=packed.nbytes,
            identity=adapter_identity(packed),
            unified=layout,
        )
        with self._lock:
            fits = self._fits_pool(made)
        if not fits:
            raise AdapterError(
                f"adapter {name!r} takes {layout.num_pages} KV pages; the pool can give an adapter "
                f"{self._kv.num_pages - self._room} beside one max_seq_len sequence (raise num_pages or "
                "kv_memory_fraction)"
            )
        return made

    def _host_runs(self, packed: np.ndarray) -> tuple[np.ndarray | jax.Array, ...]:
        """`packed`'s pages cut into runs of compiled counts, each contiguous and where registered
        adapters live (pinned_host on accelerators: its page-in is then a DMA, no host copy)."""
        runs, start = [], 0
        for size in page_runs(packed.shape[1], self._sizes):
            run = np.ascontiguousarray(packed[:, start : start + size])
            start += size
            if self._host_sharding is not None:
                run = jax.block_until_ready(jax.device_put(run, self._host_sharding))
            runs.append(run)
        return tuple(runs)

    def host_nbytes(self, rank: int) -> int:
        layout = adapter_layout(
            dict.fromkeys(self.lora_config.target_modules, rank), self.model_config, self.lora_config, self.page_size
        )
        return adapter_nbytes(layout, self.model_config, self.page_size, self.dtype.itemsize)

    def _bytes_estimate(self, source: str | Path | HostAdapter) -> int:
        if isinstance(source, HostAdapter) and source.rank <= self.lora_config.max_rank:
            ranks = module_ranks(source.weights, self.lora_config)
            layout = adapter_layout(ranks, self.model_config, self.lora_config, self.page_size)
            return adapter_nbytes(layout, self.model_config, self.page_size, self.dtype.itemsize)
        return self.slot_nbytes

    def host_entries(self, name: str):
        raise NotImplementedError("a unified bank keeps pages, not slot entries: read host_adapter(name).pages()")

    # ---------------------------------------------------------------- device memory, for tests and metrics
    def device_nbytes(self, name: str) -> int:
        """KV-pool bytes the resident adapter `name` holds (0 when it is not resident)."""
        with self._lock:
            return len(self._pages_of.get(name, ())) * self.page_nbytes

    def pool_usage(self) -> dict:
        """The KV pool as adapters and sequences share it: pages (total), adapter_pages, free_pages
        (free or cached), and bytes / adapter_bytes."""
        with self._lock:
            adapter_pages = self._owned_pages
        total = self._kv.num_pages if self._kv is not None else 0
        free = self._kv.num_takeable if self._kv is not None else 0
        return {
            "pages": total,
            "adapter_pages": adapter_pages,
            "free_pages": free,
            "bytes": total * self.page_nbytes,
            "adapter_bytes": adapter_pages * self.page_nbytes,
        }

    def check(self) -> None:
        with self._lock:
            self._table.check()
            resident = self._table.resident()
            invariant(set(self._pages_of) == set(resident), "pages and slots disagree on who is resident")
            invariant(set(self._owner_of) == set(resident), "owners and slots disagree on who is resident")
            invariant(self._owned_pages == sum(len(p) for p in self._pages_of.values()), "owned pages miscounted")
            if self._kv is not None:
                for name, pages in self._pages_of.items():
                    invariant(self._kv.owned(self._owner_of[name]) == pages.tolist(), f"{name!r}'s pages disagree")
            for name, pages in self._pages_of.items():
                adapter = self._registry.get(name)
                invariant(adapter is None or len(pages) == adapter.unified.num_pages, f"{name!r} holds too few pages")
            invariant(self._ready <= set(resident), "a ready adapter has no slot")
            invariant(not self._ready & {n for n in self._pending.values() if n}, "ready and pending at once")
            invariant(all(self._table.name_in(s) == n for s, n in self._pending.items() if n), "stale write")
            invariant(all(self._table.refcount(n) > 0 and n not in resident for n in self._waiting), "bad wait")

    # ---------------------------------------------------------------- reclaim (the page table asks; engine thread)
    def _idle(self) -> list[str]:
        """Residents sequences may take back, least recently used first (lock held)."""
        return [n for n in self._table.resident_lru() if not self._table.is_pinned(n) and n not in self._protected]

    def reclaimable_pages(self) -> int:
        with self._lock:
            return sum(len(self._pages_of[n]) for n in self._idle())

    def reclaim(self) -> None:
        with self._lock:
            idle = self._idle()
            if not idle:
                raise RuntimeError("no idle adapter to reclaim pages from")
            self._evict(idle[0])
            self.metrics.reclaimed += 1

    # ---------------------------------------------------------------- scheduling (lock held)
    def _needed(self, name: str) -> int | None:
        adapter = self._registry.get(name)
        return None if adapter is None else adapter.unified.num_pages

    def _can_fit(self, name: str, exclude: Iterable[str] = ()) -> bool:
        """Whether free and cached pages, plus those of evictable residents, cover `name`'s pages and
        leave the reserve; False before `attach` (no pool yet: the page-in waits)."""
        needed = self._needed(name)
        if needed is None:
            return True
        if self._kv is None:
            return False
        exclude = set(exclude) | {name}
        pinned = sum(len(p) for n, p in self._pages_of.items() if n != name and self._table.is_pinned(n))
        if self._kv.num_pages - pinned - needed < self._room:
            return False  # it would leave no room for a sequence beside the pinned adapters
        evictable = sum(len(p) for n, p in self._pages_of.items() if n not in exclude and not self._table.is_pinned(n))
        return self._kv.num_takeable - self._reserve + evictable >= needed

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
        while self._kv.num_takeable - self._reserve < needed:  # `_can_fit` promised enough evictable pages
            self._evict(self._table.victim(exclude | {name}))
        owner = f"{name}#{next(self._owners)}"
        self._pages_of[name] = self._kv.take_for(owner, needed)
        self._owner_of[name] = owner
        self._owned_pages += needed
        self._queue_write(slot, name)
        self._scheduled_at[name] = time.perf_counter()
        return True

    def _free_pages(self, name: str) -> None:
        pages, owner = self._pages_of.pop(name), self._owner_of.pop(name)
        self._owned_pages -= len(pages)
        if getattr(self._local, "deferring", False):
            self._dead_owners.append(owner)  # an API thread: the engine thread gives them back
        elif self._kv is not None:
            self._kv.give_back(owner)

    def _serve_waiting(self) -> None:
        if not getattr(self._local, "deferring", False):
            super()._serve_waiting()

    def unregister(self, name: str, *, wait: bool = True, timeout: float | None = None) -> None:
        self._local.deferring = True
        try:
            super().unregister(name, wait=wait, timeout=timeout)
        finally:
            self._local.deferring = False

    def prefetch(self, names: Iterable[str]) -> None:
        names = list(names)
        with self._lock:
            self._protected = set(names)
        super().prefetch(names)

    # ---------------------------------------------------------------- device work (engine thread)
    def _write_args(self, slot: int, name: str | None) -> tuple:
        """(slot, page ids, the host copy's runs, table rows) of one write; a reset has no pages."""
        if name is None:
            return slot, None, None, slot_rows(None, np.zeros(0, np.int32), self.lora_config, self.max_pages)
        adapter, ids = self._registry.get(name), self._pages_of[name]
        return slot, ids, adapter.flat, slot_rows(adapter.unified, ids, self.lora_config, self.max_pages)

    def _to_device(self, args: tuple) -> tuple:
        """Starts the copy of each run of the host copy: (slot, page ids, [(the run's page ids, its
        pages on the device)], table rows)."""
        slot, ids, runs, rows = args
        if ids is None:
            return np.int32(slot), None, [], rows
        writes, start = [], 0
        for run in runs:
            size = run.shape[1]
            writes.append((ids[start : start + size], jax.device_put(run, self._device_sharding)))
            start += size
        if start != len(ids):
            raise RuntimeError(f"the host copy has {start} pages, its placement {len(ids)}")
        return np.int32(slot), ids, writes, rows

    def _stage(self) -> None:
        with self._lock:
            for owner in self._dead_owners:
                self._kv.give_back(owner)
            self._dead_owners.clear()
        super()._stage()

    def _write_staged(self) -> None:
        """The staged writes in issue order; a page-in whose adapter no longer holds the pages it was
        staged for (evicted since) writes nothing: its pages may be a sequence's now."""
        staged, self._staged = self._staged, []
        with self._lock:
            live = [
                (slot, name, args) for slot, name, args in staged if name is None or self._pages_of.get(name) is args[1]
            ]
        for _, _, (slot, _, writes, rows) in live:
            for run_ids, pages in writes:
                kv = self._runner.kv
                k, v = write_adapter_pages((kv.k, kv.v), run_ids, pages)
                self._runner.kv = dataclasses.replace(kv, k=k, v=v)
            self.state = write_slot(self.state, slot, rows)
        with self._lock:
            self._finish_writes([(slot, name) for slot, name, _ in live], None)

    def warmup(self) -> None:
        """Compiles the page write at every run size (`page_counts`) and the slot write, writing pages
        past the pool and a slot past the tables (dropped: nothing changes). Needs `attach`."""
        if self._runner is None:
            raise RuntimeError("attach the unified pager to an engine before warming it up")
        model, kv = self.model_config, self._runner.kv
        for size in self._sizes:
            ids = np.full((size,), self._kv.num_pages, np.int32)
            pages = np.zeros((model.num_layers, size, 2, *kv.k.shape[2:]), self.dtype)
            k, v = write_adapter_pages((kv.k, kv.v), ids, jax.device_put(pages, self._device_sharding))
            kv = dataclasses.replace(kv, k=k, v=v)
        self._runner.kv = kv
        rows = slot_rows(None, np.zeros(0, np.int32), self.lora_config, self.max_pages)
        self.state = write_slot(self.state, np.int32(self.max_slots), rows)
        jax.block_until_ready((self.state, self._runner.kv))

    def place_on(self, mesh: jax.sharding.Mesh) -> None:
        raise ValueError("the unified adapter bank runs on one device; use lora.bank='padded' with a mesh")
