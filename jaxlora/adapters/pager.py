"""The adapter pager: thousands of registered adapters in host memory, a few device slots.

Life of a page-in:

    acquire(name)     pin the adapter; resident and written -> its slot (a hit), else pick a slot
                      (free, or the least recently used unpinned one) and queue a write -> None
    commit()          right after a step is dispatched: per queued adapter, ONE host->device copy of
                      its flat host buffer (registry.FlatLayout) and one jitted in-place write into
                      its slot of the donated bank (bank.write_slot_flat); ready for the next step
    is_ready(name)    the slot once written (the engine polls this; acquire is called once per request)
    release(name)     unpin; an unpinned slot may be evicted for another adapter

Engine loop order, per step (jaxlora.engine.Engine.step): admit (acquire once per new request;
`can_place` says whether it would get a slot), `prefetch` the queue head, build slot ids from
`is_ready`, dispatch step N with `bank`, then `commit()`, then block on step N's tokens, then
`release` finished requests. A step with nothing to dispatch still calls `commit()`, so requests
waiting for a page-in progress. Read `pager.bank` afresh for every step: `commit` donates the old one.

Overlap comes from JAX's asynchronous dispatch: `commit` returns as soon as the copies and writes are
enqueued, while step N is still running on the device, so the host->device copies run under it:
`commit` issues every copy first (they read nothing of the bank), then the writes. A write consumes
the bank step N reads, so it is ordered after that step, and step N+1 consumes the written bank, so
it waits for the writes. A pinned slot is never evicted, so no row of a step in
flight can see its adapter change under it.

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
    slot_nbytes,
)
from jaxlora.adapters.slot_table import SlotTable, invariant
from jaxlora.config import LoraConfig, ModelConfig
from jaxlora.errors import AdapterInUseError, UnknownAdapterError
from jaxlora.lora.bank import Bank, init_bank, write_slot_flat
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.validate import check_adapter_name

_RESET = None  # a pending op that zeroes a slot instead of writing an adapter


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdapterInfo:
    """What `list` reports about one registered adapter.

    Attributes:
      nbytes: host bytes held (padded to the bank's rank and modules, in the bank dtype).
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
      max_page_ins_per_commit: cap on slot writes issued by one `commit` (None = all pending), to
        bound how much copying overlaps one decode step.
      time_transfers: block on every page-in to time it (fills `metrics.transfer_seconds`; for
        benchmarks only, it removes the overlap).
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
        max_page_ins_per_commit: int | None = None,
        time_transfers: bool = False,
        mesh: jax.sharding.Mesh | None = None,
    ) -> None:
        if max_page_ins_per_commit is not None and max_page_ins_per_commit < 1:
            raise ValueError(f"{max_page_ins_per_commit=} must be >= 1 or None")
        self.model_config = model_config
        self.lora_config = lora_config
        self.dtype = jnp.dtype(dtype)
        self.max_slots = lora_config.max_slots
        self.max_page_ins_per_commit = max_page_ins_per_commit
        self.time_transfers = time_transfers
        self.metrics = PagerMetrics()
        self.slot_nbytes = slot_nbytes(model_config, lora_config, self.dtype)
        self.layout = FlatLayout.for_bank(model_config, lora_config, self.dtype)
        if self.layout.nbytes != self.slot_nbytes:
            raise AssertionError(f"flat layout holds {self.layout.nbytes} bytes, a slot {self.slot_nbytes}")
        self._device = device or jax.devices()[0]
        self._host_sharding = host_sharding(self._device, HostMemory(host_memory))
        self._device_sharding = jax.sharding.SingleDeviceSharding(
            self._device, memory_kind=self._device.default_memory().kind)

        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)  # notified when a refcount drops to 0
        self._registry = Registry(host_capacity_bytes)
        self._table = SlotTable(self.max_slots)
        self._ready: set[str] = set()  # resident and written
        self._pending: dict[int, str | None] = {}  # slot -> adapter to write (or _RESET), oldest first
        self._scheduled_at: dict[str, float] = {}  # when each pending page-in was scheduled
        self._waiting: dict[str, None] = {}  # pinned, no slot yet (every slot pinned); FIFO
        self._unregistering: set[str] = set()

        self.mesh: jax.sharding.Mesh | None = None
        self._entry_sharding = self._device_sharding  # where an adapter's flat buffer goes before the write
        self._zeros_flat = self._on_host(self.layout.zeros())  # what a reset writes
        self.bank: Bank = jax.device_put(init_bank(model_config, lora_config, self.dtype), self._device_sharding)
        if mesh is not None:
            self.place_on(mesh)
        else:
            self._warm_up()

    def place_on(self, mesh: jax.sharding.Mesh) -> None:
        """Splits the bank over a tensor-parallel mesh (keeping every written slot) and compiles the
        sharded slot write. Call before serving, from the engine thread."""
        from jaxlora.parallel.sharding import shard_bank

        self.bank = shard_bank(self.bank, mesh)
        # The flat buffer is copied whole to every device of the mesh (replicated); the jitted write
        # slices out what each shard of the bank holds, on the device, and compiles once like the
        # single-device one. The copy goes host -> `device` first (one transfer off pinned_host, the
        # path the single-device pager uses), then device -> mesh over the device links (see _write).
        self._entry_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.mesh = mesh
        self._warm_up()

    # ---------------------------------------------------------------- registry (any thread)
    def register(self, name: str, source: str | Path | HostAdapter) -> AdapterInfo:
        """Loads, validates and stores an adapter in host memory; it is paged in on first use.

        Args:
          name: the name requests use.
          source: a PEFT folder (adapter_config.json + adapter_model.safetensors) or a HostAdapter.

        Raises:
          AdapterError: invalid name, name taken, or an adapter that does not fit model and bank.
          CapacityError: the host budget cannot hold one more adapter.
        """
        check_adapter_name(name)
        with self._lock:
            self._registry.reserve(name, self.slot_nbytes)
        try:
            adapter = prepare_adapter(name, source, model=self.model_config, lora=self.lora_config,
                                      dtype=self.dtype, sharding=self._host_sharding, layout=self.layout)
        except BaseException:
            with self._lock:
                self._registry.cancel(name)
            raise
        with self._lock:
            self._registry.add(adapter)
            return self._info(adapter)

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
                        f"adapter {name!r} is used by {self._table.refcount(name)} running request(s)")
                self._unregistering.add(name)
                try:
                    if not self._released.wait_for(lambda: not self._table.refcount(name), timeout):
                        raise AdapterInUseError(f"adapter {name!r} is still used by "
                                                f"{self._table.refcount(name)} request(s) after {timeout} s")
                finally:
                    self._unregistering.discard(name)
            self._registry.remove(name)
            self._ready.discard(name)
            self._scheduled_at.pop(name, None)
            slot = self._table.free(name)
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

    def commit(self) -> None:
        """Issues the queued page-ins: per adapter one async host->device copy of its flat buffer
        and one in-place slot write.

        Called by the engine right after it dispatches a step (before blocking on its tokens), so
        the copies overlap that step; returns without waiting for them. The written adapters are
        ready (is_ready) from the next step on. Only the engine thread may call it.
        """
        with self._lock:
            self._serve_waiting()
            ops = self._take_pending()
        if self.time_transfers:  # one at a time, each copy and write timed on its own
            done = [(slot, name, self._write(slot, flat)) for slot, name, flat in ops]
        else:
            # Every copy first: they need nothing from the bank, so all of them start at once, under
            # the step in flight; each write then waits only for its own copy (and that step).
            copies = [(slot, name, self._to_device(flat)) for slot, name, flat in ops]
            for slot, _, on_device in copies:
                self.bank = write_slot_flat(self.bank, slot, on_device)
            done = [(slot, name, None) for slot, name, _ in copies]
        with self._lock:
            for slot, name, seconds in done:
                self._finish_write(slot, name, seconds)

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
            return {"resident": self._table.resident(), "ready": set(self._ready),
                    "pending": dict(self._pending), "waiting": list(self._waiting),
                    "refcounts": {n: self._table.refcount(n) for n in self._registry.names()
                                  if self._table.refcount(n)}}

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
        return AdapterInfo(name=name, rank=adapter.rank, target_modules=adapter.target_modules,
                           nbytes=adapter.nbytes, in_flight=self._table.refcount(name), source=adapter.source,
                           resident=self._table.slot_of(name) if name in self._ready else None)

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

    def _queue_write(self, slot: int, name: str | None) -> None:
        self._pending.pop(slot, None)  # a newer op on the slot replaces an older one
        self._pending[slot] = name

    def _serve_waiting(self) -> None:
        while self._waiting and self._table.can_assign():
            name = next(iter(self._waiting))
            del self._waiting[name]
            self._schedule(name, may_wait=True)

    def _take_pending(self) -> list[tuple[int, str | None, np.ndarray | jax.Array | None]]:
        num = len(self._pending) if self.max_page_ins_per_commit is None else self.max_page_ins_per_commit
        ops = []
        for slot in list(self._pending)[:num]:
            name = self._pending.pop(slot)
            ops.append((slot, name, None if name is None else self._registry.get(name).flat))
        return ops

    def _finish_write(self, slot: int, name: str | None, seconds: float | None) -> None:
        if name is None:
            return
        adapter = self._registry.get(name)
        self.metrics.page_ins += 1
        self.metrics.bytes_moved += adapter.nbytes if adapter else 0
        scheduled = self._scheduled_at.pop(name, None)
        if scheduled is not None:
            self.metrics.page_in_seconds.append(time.perf_counter() - scheduled)
        if seconds is not None and adapter is not None:
            self.metrics.transfer_seconds.append(seconds)
            self.metrics.timed_bytes += adapter.nbytes
            self.metrics.timed_seconds += seconds
        # Unregistered or evicted while the write ran: the slot is someone else's now.
        if self._table.name_in(slot) == name and slot not in self._pending:
            self._ready.add(name)

    # ---------------------------------------------------------------- device work (engine thread, no lock)
    def _write(self, slot: int, flat: np.ndarray | jax.Array | None) -> float | None:
        """Copies one adapter's flat buffer (None: zeros) to the device in one transfer and writes it
        into `slot` of the donated bank. With `time_transfers`, blocks and returns the seconds from
        the copy's dispatch to the written bank."""
        start = time.perf_counter()
        self.bank = write_slot_flat(self.bank, slot, self._to_device(flat))
        if not self.time_transfers:
            return None
        jax.block_until_ready(self.bank)
        return time.perf_counter() - start

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
        """Compiles the slot write. The constructor already did, so this is a no-op kept for callers
        that warm every component; it never touches a slot that may hold an adapter."""

    def _warm_up(self) -> None:
        """Compiles the slot write once, through the same path as page-ins (zero compiles later).

        Writes zeros into slot 1, which only ever holds zeros or an adapter queued after this runs.
        """
        self._write(1, self._zeros_flat)
        jax.block_until_ready(self.bank)
