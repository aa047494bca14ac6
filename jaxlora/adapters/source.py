"""The contract between the engine and whatever holds its adapters: `AdapterSource`.

Two implementations: `jaxlora.adapters.Pager` (thousands of adapters in host memory, a few device
slots, page-ins overlapped with the steps) and `jaxlora.adapters.ResidentBank` (a fixed set of
adapters already in the device bank, for benchmarks and tests that measure decoding, not paging).

When the engine calls each member is written once, in the step order of `jaxlora.engine.engine`'s
module docstring; the scheduler's use (pins and admission) is in `jaxlora.engine.scheduler`'s.
This module imports nothing at run time, so the scheduler stays importable without JAX.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import jax

    from jaxlora.adapters.metrics import PagerMetrics
    from jaxlora.adapters.pager import AdapterInfo
    from jaxlora.lora.bank import Bank
    from jaxlora.lora.host_adapter import HostAdapter


class AdapterSource(Protocol):
    """Adapter name -> device slot of the bank the engine's step reads (slot 0: the base model).

    Slots (the scheduler, engine thread):
      acquire(name): pin `name` for one request (call once per request); its slot if a step may
        read it now, else None and its page-in is queued. Raises UnknownAdapterError.
      release(name): undo one acquire; an unpinned slot may be given to another adapter.
      is_ready(name): the slot once written (a step may read it), else None.
      slot_at_commit(name): the slot if a step dispatched after the next `commit()` may read it.
      slot_of(name): the slot assigned to `name`, written or with its write still queued, else None.
      can_place(name): whether acquiring `name` now gets a slot without waiting for a release.
      identity(name): a digest of the adapter's weights (prefix-cache keys; see
        `jaxlora.engine.prefix_hash`): equal only for equal weights, whatever the name.

    Device work around each step (the engine thread):
      prefetch(names): queue page-ins, without pins, for adapters that waiting requests will need.
      stage(): start the host->device copies of queued page-ins (before a step's dispatch).
      commit(): write staged copies into their slots (after the dispatch; see the step order).
      bank: the device bank; read it afresh for every step, since `commit` may replace it.
      warmup(): compile the slot writes, so serving compiles nothing; safe to call at any time.
      mesh: the tensor-parallel mesh the bank is split over (None: one device); the engine checks
        that it is its own (`jaxlora.engine.build_engine` hands one mesh to both).

    Registry (any thread):
      register(name, source) / unregister(name): add or remove an adapter at run time;
      has(name), list(): what requests may name; max_slots: slots of the bank, slot 0 included;
      metrics: hit, miss, page-in and eviction counters.
    """

    @property
    def max_slots(self) -> int: ...

    @property
    def bank(self) -> Bank: ...

    @property
    def mesh(self) -> jax.sharding.Mesh | None: ...

    @property
    def metrics(self) -> PagerMetrics: ...

    # Slots.
    def acquire(self, name: str) -> int | None: ...

    def release(self, name: str) -> None: ...

    def is_ready(self, name: str) -> int | None: ...

    def slot_at_commit(self, name: str) -> int | None: ...

    def slot_of(self, name: str) -> int | None: ...

    def can_place(self, name: str) -> bool: ...

    def identity(self, name: str) -> bytes: ...

    # Device work around each step.
    def prefetch(self, names: Iterable[str]) -> None: ...

    def stage(self) -> None: ...

    def commit(self) -> None: ...

    def warmup(self) -> None: ...

    # Registry.
    def register(self, name: str, source: str | Path | HostAdapter) -> AdapterInfo: ...

    def unregister(self, name: str, *, wait: bool = True, timeout: float | None = None) -> None: ...

    def has(self, name: str) -> bool: ...

    def list(self) -> list[AdapterInfo]: ...
