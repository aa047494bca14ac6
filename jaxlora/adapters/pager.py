"""The adapter pager: thousands of registered adapters in host memory, a few device slots.

Life of a page-in:

    acquire(name)     pin the adapter; resident and written -> its slot (a hit), else pick a slot
                      (free, or the least recently used unpinned one) and queue a write -> None
    prefetch(names)   queue page-ins (no pin) for the adapters of waiting requests
    stage()           right BEFORE a step is dispatched: per queued adapter, ONE host->device copy
                      of its flat host buffer (registry.FlatLayout, at the adapter's rank class)
                      starts
    commit()          right AFTER the step is dispatched: ONE jitted call per rank class among them
                      (usually one) writes every staged copy, widened to the bank's rank, into its
                      slot of the donated bank (registry.slot_writer); ready next step
    is_ready(name)    the slot once written (the engine polls this; acquire is called once per request)
    release(name)     unpin; an unpinned slot may be evicted for another adapter

When the engine calls each of these (and why a commit may go before the dispatch) is the step order
in `jaxlora.engine.engine`'s module docstring. Read `pager.bank` afresh for every step: `commit`
donates the old one. The pager implements `jaxlora.adapters.AdapterSource`.

Why the split (benchmarks/DECISIONS.md#adapter-page-in): a host->device copy
waits for the work already queued on the device when it is issued. Staged before step N+1's
dispatch, the copies wait for step N and then run under step N+1; the write, issued after the
dispatch, consumes the bank step N+1 reads, so it runs after that step, and step N+2 consumes the
written bank. So the copies hide under a step instead of adding their time to it, as they do when
copies and writes are both issued after the dispatch. One write call for all page-ins
(not one per adapter) matters too: each call whose input copy was still in flight held the host
for about that copy's time. A pinned slot is never evicted, so no row of a step in flight can see
its adapter change under it.

Threads: the engine loop calls acquire/release/commit/prefetch; gRPC threads call
register/unregister/list. One lock guards all bookkeeping; only the engine thread touches `bank`, and
the device calls in `commit` run with the lock released.

Tensor parallelism: with a `mesh` the bank is split over the devices S-LoRA style
(jaxlora.parallel.sharding); every page-in copies the adapter's flat buffer whole to each device of
the mesh (replicated, still one buffer) and the jitted write keeps each shard's part, so the written
bank keeps its layout. The copy is staged: host -> the pager's `device` (the one pinned_host copy),
then device -> every device of the mesh.
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
from jaxlora.adapters.registry import (
    FlatLayout,
    HostMemory,
    RegisteredAdapter,
    Registry,
    host_sharding,
    prepare_adapter,
    rank_class,
    slot_nbytes,
    slot_writer,
)
from jaxlora.adapters.slot_table import SlotTable, invariant
from jaxlora.config import LoraConfig, ModelConfig
from jaxlora.errors import AdapterInUseError, UnknownAdapterError
from jaxlora.lora.bank import Bank, init_bank
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.validate import check_adapter_name

_RESET = None  # a pending op that zeroes a slot instead of writing an adapter


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterInfo:
    """What `list` reports about one registered adapter.

    Attributes:
      nbytes: host bytes held (padded to the adapter's rank class and the bank's modules, in the
        bank dtype; see `jaxlora.adapters.registry`).
      resident: the device slot holding it, written and usable; None when not on the device yet.
      in_flight: requests pinning it (its refcount).
    """

    name: str
    rank: int
    target_modules: tuple[str, ...]
    nbytes: int
    resident: int | None
    in_flight: int
    source: str


class Pager:
    """Registry + slot table + device bank; see the module docstring for the protocol.

    Args:
      model_config, lora_config: shapes of the bank (`lora_config.max_slots` slots incl. slot 0).
      host_capacity_bytes: budget for registered adapters in host memory; None = unbounded.
      dtype: the bank's dtype; host copies are kept in it, so a page-in is a plain copy.
      host_memory: where host copies live (pinned_host on accelerators by default).
      device: the device holding the bank (default: the first device); with a mesh, where host
        copies are pinned.
      mesh: a tensor-parallel mesh (jaxlora.parallel.make_mesh) to split the bank over, or None.
      max_page_ins_per_commit: cap on page-ins issued by one `commit`, to bound how much copying
        overlaps one decode step (benchmarks/DECISIONS.md#adapter-page-in). The write
        is compiled once per power of two up to it.
      time_transfers: block on every page-in to time it (fills `metrics.transfer_seconds`; for
        benchmarks only, it removes the overlap).
      compile_writes: compile every slot write now (`warmup`); False leaves each to compile on its
        first use, for a one-shot command that may page in nothing.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        lora_config: LoraConfig,
        *,
        host_capacity_bytes: int | None = None,
        dtype: jnp.dtype = jnp.float32,
        host_memory: HostMemory | str = HostMemory.AUTO,
        device: jax.Device | None = None,
        max_page_ins_per_commit: int = 16,
        time_transfers: bool = False,
        mesh: jax.sharding.Mesh | None = None,
        compile_writes: bool = True,
    ) -> None:
        if not isinstance(max_page_ins_per_commit, int) or max_page_ins_per_commit < 1:
            raise ValueError(f"{max_page_ins_per_commit=} must be an int >= 1")
        self.model_config = model_config
        self.lora_config = lora_config
        self.dtype = jnp.dtype(dtype)
        self.max_slots = lora_config.max_slots
        self.max_page_ins_per_commit = max_page_ins_per_commit
        # Compiled sizes of the multi-slot write: 1, 2, 4, ... and the cap itself.
        self._write_sizes = tuple(
            sorted(
                {2**i for i in range(max_page_ins_per_commit.bit_length()) if 2**i < max_page_ins_per_commit}
                | {max_page_ins_per_commit}
            )
        )
        self.time_transfers = time_transfers
        self.metrics = PagerMetrics()
        self.slot_nbytes = slot_nbytes(model_config, lora_config, self.dtype)  # a whole slot: the most
        # rank class -> layout of a host copy padded to it; the largest is a whole slot.
        self.layouts = FlatLayout.classes_for_bank(model_config, lora_config, self.dtype)
        self.layout = self.layouts[lora_config.max_rank]
        self._class_of_size = {layout.size: r for r, layout in self.layouts.items()}
        if self.layout.nbytes != self.slot_nbytes:
            raise AssertionError(f"flat layout holds {self.layout.nbytes} bytes, a slot {self.slot_nbytes}")
        # rank class -> the jitted write of a commit's copies of that class (widened to R on the device)
        self._writers = {r: slot_writer(layout, self.layout) for r, layout in self.layouts.items()}
        self._device = device or jax.devices()[0]
        self._host_sharding = host_sharding(self._device, HostMemory(host_memory))
        self._device_sharding = jax.sharding.SingleDeviceSharding(
            self._device, memory_kind=self._device.default_memory().kind
        )

        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified when a refcount drops to 0
        self._registry = Registry(host_capacity_bytes)
        self._table = SlotTable(self.max_slots)
        self._ready: set[str] = set()  # resident and written
        self._pending: dict[int, str | None] = {}  # slot -> adapter to write (or _RESET), oldest first
        self._scheduled_at: dict[str, float] = {}  # when each pending page-in was scheduled
        self._waiting: dict[str, None] = {}  # pinned, no slot yet (every slot pinned); FIFO
        self._staged: list[tuple[int, str | None, jax.Array]] = []  # (slot, name, copy in flight), in order
        self._unregistering: set[str] = set()

        self.mesh: jax.sharding.Mesh | None = None
        self._entry_sharding = self._device_sharding  # where an adapter's flat buffer goes before the write
        # What a reset writes: zeros of the smallest class (the fewest bytes to copy), widened.
        self._zeros_flat = self._on_host(self.layouts[min(self.layouts)].zeros())
        self.bank: Bank = jax.device_put(init_bank(model_config, lora_config, self.dtype), self._device_sharding)
        if mesh is not None:
            self.place_on(mesh, compile_writes=compile_writes)
        elif compile_writes:
            self.warmup()

    def place_on(self, mesh: jax.sharding.Mesh, *, compile_writes: bool = True) -> None:
        """Splits the bank over a tensor-parallel mesh (keeping every written slot) and compiles the
        sharded slot write (unless not `compile_writes`). Call before serving, from the engine thread."""
        from jaxlora.parallel.sharding import shard_bank

        self.bank = shard_bank(self.bank, mesh)
        # The flat buffer is copied whole to every device of the mesh (replicated); the jitted write
        # slices out what each shard of the bank holds, on the device, and compiles once like the
        # single-device one. The copy goes host -> `device` first (one transfer off pinned_host, the
        # path the single-device pager uses), then device -> mesh over the device links (see _write).
        self._entry_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.mesh = mesh
        if compile_writes:
            self.warmup()

    # ---------------------------------------------------------------- registry (any thread)
    def register(self, name: str, source: str | Path | HostAdapter) -> AdapterInfo:
        """Loads, validates and stores an adapter in host memory; it is paged in on first use.

        Args:
          name: the name requests use.
          source: a PEFT folder (adapter_config.json + adapter_model.safetensors) or a HostAdapter.

        Raises:
          AdapterError: invalid name, or an adapter that does not fit model and bank.
          AdapterExistsError: the name is registered, or being registered by another call.
          CapacityError: the host budget cannot hold one more adapter.
        """
        check_adapter_name(name)
        with self._lock:
            self._registry.reserve(name, self._bytes_estimate(source))
        start = time.perf_counter()
        try:
            adapter = self._prepare(name, source)
        except BaseException:
            with self._lock:
                self._registry.cancel(name)
            raise
        with self._lock:
            self._registry.add(adapter)
            self.metrics.host_load.observe(time.perf_counter() - start)
            return self._info(adapter)

    def _prepare(self, name: str, source: str | Path | HostAdapter) -> RegisteredAdapter:
        """Loads, validates and packs one adapter for host memory (slow: no lock held)."""
        return prepare_adapter(
            name,
            source,
            model=self.model_config,
            lora=self.lora_config,
            dtype=self.dtype,
            sharding=self._host_sharding,
            layouts=self.layouts,
        )

    def host_nbytes(self, rank: int) -> int:
        """Host bytes one registered adapter of `rank` takes (its rank class's copy)."""
        return self.layouts[rank_class(rank, self.layouts)].nbytes

    def _bytes_estimate(self, source: str | Path | HostAdapter) -> int:
        """Host bytes to reserve before loading `source`: its rank class's when the rank is known
        without reading files (a HostAdapter), else a whole slot's (the most any adapter takes;
        `Registry.add` then charges what it really took)."""
        if isinstance(source, HostAdapter) and 1 <= source.rank <= self.lora_config.max_rank:
            return self.host_nbytes(source.rank)
        return self.slot_nbytes

    def unregister(self, name: str, *, wait: bool = True, timeout: float | None = None) -> None:
        """Forgets an adapter and frees its slot (zeroed at the next commit).

        New acquires of the adapter fail at once; running requests keep it until they release it.

        Args:
          wait: wait for running requests to release it; False refuses at once if any use it.
          timeout: seconds to wait at most (None: no limit).

        Raises:
          UnknownAdapterError: not registered (or being unregistered by another call).
          AdapterInUseError: still in use (wait=False, or the timeout passed).
        """
        with self._lock:
            self._lookup(name)
            if self._table.refcount(name):
                if not wait:
                    raise AdapterInUseError(
                        f"adapter {name!r} is used by {self._table.refcount(name)} running request(s)"
                    )
                self._unregistering.add(name)
                try:
                    if not self._released.wait_for(lambda: not self._table.refcount(name), timeout):
                        raise AdapterInUseError(
                            f"adapter {name!r} is still used by "
                            f"{self._table.refcount(name)} request(s) after {timeout} s"
                        )
                finally:
                    self._unregistering.discard(name)
            self._registry.remove(name)
            self._ready.discard(name)
            self._scheduled_at.pop(name, None)
            slot = self._free_slot(name)
            if slot is not None:
                self._queue_write(slot, _RESET)
            self._serve_waiting()

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._registry and name not in self._unregistering

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(self._registry.get(n)) for n in self._registry.names()]

    def info(self, name: str) -> AdapterInfo:
        with self._lock:
            return self._info(self._lookup(name))

    @property
    def registered_bytes(self) -> int:
        with self._lock:
            return self._registry.used_bytes

    # ---------------------------------------------------------------- engine thread
    def acquire(self, name: str) -> int | None:
        """Pins `name` for one request: its slot if usable now, else None and a page-in is queued.

        Call once per request and poll `is_ready` afterwards; every acquire needs one `release`.
        When every slot is pinned the page-in waits (FIFO) for a slot to be released.

        Raises:
          UnknownAdapterError: not registered, or being unregistered.
        """
        with self._lock:
            self._lookup(name)
            self._table.pin(name)
            if name in self._ready:
                self.metrics.hits += 1
                return self._table.slot_of(name)
            self.metrics.misses += 1
            if self._table.slot_of(name) is None and name not in self._waiting:
                self._schedule(name, may_wait=True)
            return None

    def release(self, name: str) -> None:
        """Unpins one acquire of `name`; at refcount 0 its slot may be evicted."""
        with self._lock:
            if not self._table.refcount(name):
                raise ValueError(f"release({name!r}) without a matching acquire")
            if self._table.unpin(name) == 0:
                self._waiting.pop(name, None)  # released before it got a slot (e.g. cancelled)
                self._released.notify_all()
                self._serve_waiting()

    def is_ready(self, name: str) -> int | None:
        """The adapter's slot if it is resident and written (usable by the next step), else None."""
        with self._lock:
            return self._table.slot_of(name) if name in self._ready else None

    def slot_at_commit(self, name: str) -> int | None:
        """The adapter's slot if it is written, or if its copy is staged and the next `commit()`
        writes it: a call dispatched after that commit may read it (the engine admits such
        requests and dispatches their prefill after the commit). Else None."""
        with self._lock:
            slot = self._table.slot_of(name)
            if name in self._ready:
                return slot
            if slot is None or slot in self._pending:  # re-queued since it was staged: not the last write
                return None
            return slot if any(s == slot and n == name for s, n, _ in self._staged) else None

    def slot_of(self, name: str) -> int | None:
        """The slot assigned to `name`, written or still pending; None if it has none."""
        with self._lock:
            return self._table.slot_of(name)

    def can_place(self, name: str) -> bool:
        """Whether acquiring `name` now would get a slot without waiting for a release.

        The scheduler uses it so a batch never needs more distinct adapters than there are slots.
        """
        with self._lock:
            return self._table.slot_of(name) is not None or (not self._waiting and self._table.can_assign())

    def identity(self, name: str) -> bytes:
        """The digest of the adapter's weights made when it was registered (`AdapterSource`); for a
        pinned adapter also while it is being unregistered (its registration stays until released)."""
        with self._lock:
            adapter = self._registry.get(name)
            if adapter is None:
                raise UnknownAdapterError(f"adapter {name!r} is not registered")
            return adapter.identity

    def prefetch(self, names: Iterable[str]) -> None:
        """Queues page-ins (no pin) for adapters of waiting requests, in order, while slots allow.

        Uses free slots and unpinned LRU slots, but never evicts another of `names`.
        """
        with self._lock:
            if self._waiting:  # every slot is pinned; requests come first
                return
            wanted = dict.fromkeys(n for n in names if n in self._registry and n not in self._unregistering)
            for name in wanted:
                if self._table.slot_of(name) is not None:
                    continue
                if not self._schedule(name, may_wait=False, exclude=wanted):
                    break
                self.metrics.prefetches += 1

    def stage(self) -> None:
        """Starts the host->device copies of the queued page-ins, without touching the bank.

        Call it right BEFORE dispatching a step, then `commit()` right after. On the GPU a
        host->device copy waits for the work already queued on the device (PJRT orders a new
        buffer's fill after the compute stream), so a copy issued before step N+1's dispatch waits
        only for step N and then runs under step N+1; issued after the dispatch, it would wait for
        step N+1 and delay step N+2 by its own time (benchmarks/DECISIONS.md#adapter-page-in).
        Calling only `commit()` is still correct; it stages what is left first.
        """
        self._stage()

    def _stage(self) -> None:
        with self._lock:
            self._serve_waiting()
            ops = self._take_pending(self.max_page_ins_per_commit - len(self._staged))
        self._staged += [(slot, name, self._to_device(flat)) for slot, name, flat in ops]

    def commit(self) -> None:
        """Writes the staged page-ins (staging what is still queued first) into their slots of the
        donated bank, in ONE jitted call; returns without waiting for the device.

        Called by the engine right after it dispatches a step (before blocking on its tokens): the
        writes read the bank that step reads, so they run after it. The written adapters are ready
        (is_ready) from the next step on. At most `max_page_ins_per_commit` page-ins per commit;
        the rest stay queued for the next. Only the engine thread may call it.
        """
        if self.time_transfers:  # one at a time, each copy and write timed on its own
            self._commit_timed()
            return
        self._stage()
        self._write_staged()

    def _write_staged(self) -> None:
        """One write call for every staged copy, then the bookkeeping."""
        staged, self._staged = self._staged, []
        if staged:
            self.bank = self._write_many([slot for slot, _, _ in staged], [on_device for _, _, on_device in staged])
        with self._lock:
            self._finish_writes([(slot, name) for slot, name, _ in staged], None)

    def _commit_timed(self) -> None:
        self._write_staged()  # copied before timing was switched on: written untimed, first (issue order)
        with self._lock:
            self._serve_waiting()
            ops = self._take_pending(self.max_page_ins_per_commit)
        for slot, name, flat in ops:
            seconds = self._write_timed(slot, flat)
            with self._lock:
                self._finish_writes([(slot, name)], seconds)

    # ---------------------------------------------------------------- tests and metrics
    def host_entries(self, name: str) -> Bank:
        """The host copy of an adapter's slot entries, as a pytree of numpy arrays (unpacked from
        its flat buffer)."""
        return self.host_adapter(name).entries

    def host_adapter(self, name: str) -> RegisteredAdapter:
        """The registered adapter as stored (its `flat` buffer, layout and byte count)."""
        with self._lock:
            adapter = self._registry.get(name)  # also while draining for unregister
        if adapter is None:
            raise UnknownAdapterError(f"adapter {name!r} is not registered")
        return adapter

    def snapshot(self) -> dict:
        """Slot table and queues, for tests and debugging."""
        with self._lock:
            return {
                "resident": self._table.resident(),
                "ready": set(self._ready),
                "pending": dict(self._pending),
                "waiting": list(self._waiting),
                "refcounts": {n: self._table.refcount(n) for n in self._registry.names() if self._table.refcount(n)},
            }

    def check(self) -> None:
        """Raises RuntimeError naming the broken invariant if the bookkeeping is inconsistent (tests)."""
        with self._lock:
            self._table.check()
            resident = self._table.resident()
            invariant(self._ready <= set(resident), "a ready adapter has no slot")
            invariant(all(n in self._registry for n in resident), "an unregistered adapter holds a slot")
            invariant(not self._ready & {n for n in self._pending.values() if n}, "ready and pending at once")
            invariant(all(self._table.name_in(s) == n for s, n in self._pending.items() if n), "stale write")
            invariant(all(self._table.refcount(n) > 0 and n not in resident for n in self._waiting), "bad wait")
            invariant(not self._waiting or not self._table.can_assign(), "a waiting adapter could have a slot")

    # ---------------------------------------------------------------- internals (lock held)
    def _lookup(self, name: str) -> RegisteredAdapter:
        adapter = self._registry.get(name)
        if adapter is None:
            raise UnknownAdapterError(f"adapter {name!r} is not registered")
        if name in self._unregistering:
            raise UnknownAdapterError(f"adapter {name!r} is being unregistered")
        return adapter

    def _info(self, adapter: RegisteredAdapter) -> AdapterInfo:
        name = adapter.name
        return AdapterInfo(
            name=name,
            rank=adapter.rank,
            target_modules=adapter.target_modules,
            nbytes=adapter.nbytes,
            in_flight=self._table.refcount(name),
            source=adapter.source,
            resident=self._table.slot_of(name) if name in self._ready else None,
        )

    def _schedule(self, name: str, *, may_wait: bool, exclude: Iterable[str] = ()) -> bool:
        """Gives `name` a slot and queues its write; if none is free, waits (may_wait) or gives up."""
        placed = self._table.assign(name, exclude)
        if placed is None:
            if may_wait:
                self._waiting[name] = None
            return False
        slot, evicted = placed
        if evicted is not None:
            self._ready.discard(evicted)
            self._scheduled_at.pop(evicted, None)
            self.metrics.evictions += 1
        self._queue_write(slot, name)
        self._scheduled_at[name] = time.perf_counter()
        return True

    def _free_slot(self, name: str) -> int | None:
        """Takes `name` out of its slot (unpinned only); the freed slot, or None if it had none."""
        return self._table.free(name)

    def _queue_write(self, slot: int, name: str | None) -> None:
        self._pending.pop(slot, None)  # a newer op on the slot replaces an older one
        self._pending[slot] = name

    def _serve_waiting(self) -> None:
        while self._waiting and self._table.can_assign():
            name = next(iter(self._waiting))
            del self._waiting[name]
            self._schedule(name, may_wait=True)

    def _take_pending(self, limit: int) -> list[tuple[int, str | None, np.ndarray | jax.Array | None]]:
        """Up to `limit` queued writes: page-ins that requests wait for (pinned) first, then slot
        resets, then prefetches, each in queue order. Without the priority a burst of prefetches
        held back the page-ins of requests ready to run (benchmarks/DECISIONS.md#adapter-page-in)."""

        def priority(slot: int) -> int:
            name = self._pending[slot]
            return 1 if name is None else (0 if self._table.refcount(name) else 2)

        ops = []
        for slot in sorted(self._pending, key=priority)[: max(limit, 0)]:
            name = self._pending.pop(slot)
            ops.append((slot, name, None if name is None else self._registry.get(name).flat))
        return ops

    def _finish_writes(self, written: list[tuple[int, str | None]], seconds: float | None) -> None:
        """Bookkeeping after writes were issued, in issue order (the last write to a slot wins)."""
        last = {slot: name for slot, name in written}
        for _slot, name in written:
            if name is None:
                continue
            adapter = self._registry.get(name)
            self.metrics.page_ins += 1
            self.metrics.bytes_moved += adapter.nbytes if adapter else 0
            scheduled = self._scheduled_at.pop(name, None)
            if scheduled is not None:
                self.metrics.observe_page_in(time.perf_counter() - scheduled)
            if seconds is not None and adapter is not None:
                self.metrics.transfer_seconds.append(seconds)
                self.metrics.timed_bytes += adapter.nbytes
                self.metrics.timed_seconds += seconds
        for slot, name in last.items():
            # Unregistered or evicted since it was staged: the slot is someone else's now, and
            # their write is still queued (or was issued after this one).
            if name is not None and self._table.name_in(slot) == name and slot not in self._pending:
                self._ready.add(name)

    # ---------------------------------------------------------------- device work (engine thread, no lock)
    def _write_timed(self, slot: int, flat: np.ndarray | jax.Array | None) -> float:
        """Copies one adapter's flat buffer (None: zeros) to the device, writes it into `slot` of
        the donated bank, blocks, and returns the seconds from the copy's dispatch to the written
        bank (`time_transfers` mode)."""
        start = time.perf_counter()
        self.bank = self._write_many([slot], [self._to_device(flat)])
        jax.block_until_ready(self.bank)
        return time.perf_counter() - start

    def _write_many(self, slots: list[int], flats: list[jax.Array]) -> Bank:
        """The writes of one commit: one jitted call per rank class among the buffers (usually one),
        each padded to a compiled size by repeating its last write (writing the same buffer to the
        same slot twice is a no-op), so nothing compiles anew. Only each slot's last write is
        issued: an earlier one in the same commit was for an adapter the slot no longer holds, and
        with it dropped the calls need no order between them."""
        last = dict(zip(slots, flats))
        by_class: dict[int, list[tuple[int, jax.Array]]] = {}
        for slot, flat in last.items():
            by_class.setdefault(self._class_of_size[flat.size], []).append((slot, flat))
        bank = self.bank
        for rank, writes in by_class.items():
            size = next(b for b in self._write_sizes if b >= len(writes))
            writes += writes[-1:] * (size - len(writes))
            bank = self._writers[rank](bank, np.array([s for s, _ in writes], np.int32), tuple(f for _, f in writes))
        return bank

    def _to_device(self, flat: np.ndarray | jax.Array | None) -> jax.Array:
        """Starts the copy of one flat buffer (None: zeros) to where the slot write reads it."""
        if flat is None:
            flat = self._zeros_flat
        if self.mesh is None:
            return jax.device_put(flat, self._entry_sharding)
        # host -> one device in one copy, then replicated device-to-device over the mesh
        return jax.device_put(jax.device_put(flat, self._device_sharding), self._entry_sharding)

    def _on_host(self, flat: np.ndarray) -> np.ndarray | jax.Array:
        """`flat` where registered adapters live (pinned_host, or numpy)."""
        if self._host_sharding is None:
            return flat
        return jax.block_until_ready(jax.device_put(flat, self._host_sharding))

    def warmup(self) -> None:
        """Compiles the slot write of every rank class at every padded size, through the same path
        as page-ins (zero compiles later). The constructor and `place_on` call it; calling it again
        is safe at any time from the engine thread.

        It writes zeros into slot 1 and then rewrites what it held: the adapter written there (its
        host buffer is what its page-in wrote), else zeros. No step is dispatched in between, and a
        slot that is not ready is read by no request; a write still queued for it is issued later,
        so it wins.
        """
        for rank, layout in self.layouts.items():
            zeros = self._to_device(layout.zeros())
            for size in self._write_sizes:
                self.bank = self._writers[rank](self.bank, np.ones(size, np.int32), (zeros,) * size)
        with self._lock:
            name = self._table.name_in(1)
            flat = self._registry.get(name).flat if name in self._ready else None
        self.bank = self._write_many([1], [self._to_device(flat)])
        jax.block_until_ready(self.bank)
