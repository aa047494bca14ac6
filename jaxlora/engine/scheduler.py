"""Who runs next: waiting and running queues, admission, prefill chunking. Plain Python, no JAX.

Admission takes waiting requests in arrival order. A request is admitted when a batch row is free
and its adapter has a written device slot. The first time a request is considered it pins its
adapter (`acquire`), unless that would exceed the cap on distinct adapters per batch or the pager
could not place it without waiting; a pinned request whose page-in is pending is skipped, so hot
requests behind it run. Once a request has waited `max_wait_steps` steps it becomes a blocker: it
pins regardless, and while it has no slot, later requests may not pin other adapters, so slot pins
and the adapter cap drain towards it (no starvation). Requests already holding a pin, and
base-model requests (no slot), still run: they release what the blocker waits for.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Protocol

from jaxlora.engine.request import Phase, Request
from jaxlora.errors import JaxloraError

BASE_SLOT = 0


class SlotSource(Protocol):
    """Adapter name -> device slot (the pager, `jaxlora.adapters.Pager`).

    acquire pins (once per request) and returns the slot if written, else queues a page-in and
    returns None; is_ready then polls; release unpins; can_place says whether acquiring now would
    get a slot without waiting for another adapter's release; slot_at_commit is is_ready for a call
    dispatched after the pager's next commit; slot_of is the slot assigned to an adapter (written, or
    its write queued), else None.
    """

    def acquire(self, name: str) -> int | None: ...

    def is_ready(self, name: str) -> int | None: ...

    def release(self, name: str) -> None: ...

    def can_place(self, name: str) -> bool: ...

    def slot_at_commit(self, name: str) -> int | None: ...

    def slot_of(self, name: str) -> int | None: ...


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens [start, start + length) of one request."""

    request: Request
    start: int
    length: int

    @property
    def is_last(self) -> bool:
        return self.start + self.length == self.request.num_prompt


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """One prefill call: up to `prefill_batch` chunks padded to `bucket` tokens."""

    bucket: int
    chunks: tuple[PrefillChunk, ...]


class Scheduler:
    def __init__(self, *, max_batch: int, prefill_batch: int, prefill_buckets: tuple[int, ...],
                 max_adapters: int, max_wait_steps: int, slots: SlotSource | None) -> None:
        self.max_batch = max_batch
        self.prefill_batch = prefill_batch
        self.prefill_buckets = tuple(sorted(prefill_buckets))
        self.max_adapters = max_adapters
        self.max_wait_steps = max_wait_steps
        self.slots = slots
        self.waiting: list[Request] = []  # arrival order
        self.running: dict[int, Request] = {}  # row -> request
        self._free_rows = list(range(max_batch))  # a heap
        self._adapter_users: collections.Counter[str] = collections.Counter()  # pins per adapter
        self._enqueued: dict[str, int] = {}  # request_id -> step it joined the queue
        self.num_steps = 0

    # Queries.
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    def decode_requests(self) -> list[Request]:
        return [r for r in self.running.values() if r.phase is Phase.DECODE]

    def active_adapters(self) -> set[str]:
        """Adapters pinned by running or waiting requests (the batch's distinct adapters)."""
        return set(self._adapter_users)

    def upcoming_adapters(self, limit: int) -> list[str]:
        """Adapters of the first `limit` waiting requests that hold no pin yet, in arrival order
        (what the engine prefetches)."""
        return list(dict.fromkeys(r.adapter for r in self.waiting[:limit] if r.adapter is not None and not r.has_pin))

    # Mutations.
    def add(self, req: Request) -> None:
        req.phase = Phase.WAITING
        self._enqueued[req.request_id] = self.num_steps
        self.waiting.append(req)

    def schedule(self) -> tuple[list[Request], list[tuple[Request, JaxloraError]]]:
        """Admits what fits now. Returns (admitted, failed): failed requests named an adapter that is
        gone (their error says why); they are out of the queue."""
        self.num_steps += 1
        admitted: list[Request] = []
        failed: list[tuple[Request, JaxloraError]] = []
        blocker: Request | None = None
        for req in list(self.waiting):
            if not self._free_rows:
                break
            if blocker is not None and req.adapter not in (None, blocker.adapter) and not req.has_pin:
                continue  # no new pins until the blocker has one; pinned requests drain
            is_starving = self.num_steps - self._enqueued[req.request_id] > self.max_wait_steps
            try:
                slot = self._try_slot(req, is_starving)
            except JaxloraError as e:
                self.finish(req)
                failed.append((req, e))
                continue
            if slot is None:
                # A starving request blocks newcomers only while it has no slot: one whose page-in
                # is already queued lands without help, and blocking behind it cost a step's
                # admissions per cold request (2,000 adapters, every request past max_wait_steps).
                if blocker is None and is_starving and not (req.has_pin and self.slots.slot_of(req.adapter) is not None):
                    blocker = req
                continue
            self._admit(req, slot)
            admitted.append(req)
        return admitted, failed

    def admit_staged(self) -> list[Request]:
        """A step's second admission pass, after the pager staged its copies: waiting requests
        that hold a pin and whose adapter the coming commit writes (`slots.slot_at_commit`) take
        free rows, in arrival order. Their prefill is dispatched after that commit, so a page-in
        costs such a request no step (S-LoRA-style: the copy runs under the step's decode)."""
        admitted: list[Request] = []
        for req in list(self.waiting):
            if not self._free_rows:
                break
            if req.adapter is None or not req.has_pin:
                continue
            slot = self.slots.slot_at_commit(req.adapter)
            if slot is not None:
                self._admit(req, slot)
                admitted.append(req)
        return admitted

    def plan_prefill(self) -> PrefillPlan | None:
        """The next prefill call: oldest rows still in prefill, one chunk each, one bucket for all."""
        pending = sorted((r for r in self.running.values() if r.phase is Phase.PREFILL), key=lambda r: r.arrival)
        if not pending:
            return None
        largest = self.prefill_buckets[-1]
        chunks = tuple(PrefillChunk(r, r.num_prefilled, min(r.num_prompt - r.num_prefilled, largest))
                       for r in pending[:self.prefill_batch])
        longest = max(c.length for c in chunks)
        bucket = next(b for b in self.prefill_buckets if b >= longest)
        return PrefillPlan(bucket=bucket, chunks=chunks)

    def finish(self, req: Request) -> None:
        """Takes a request out of the queues (finished, cancelled or failed), freeing row and pin."""
        if req.phase is Phase.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.row is not None and self.running.get(req.row) is req:
            del self.running[req.row]
            heapq.heappush(self._free_rows, req.row)
        if req.has_pin:
            req.has_pin = False
            self._adapter_users[req.adapter] -= 1
            if not self._adapter_users[req.adapter]:
                del self._adapter_users[req.adapter]
            self.slots.release(req.adapter)
        self._enqueued.pop(req.request_id, None)
        req.phase = Phase.FINISHED

    def _try_slot(self, req: Request, is_starving: bool) -> int | None:
        """The request's written slot, pinning its adapter first if it holds no pin yet."""
        name = req.adapter
        if name is None:
            return BASE_SLOT
        if self.slots is None:
            raise JaxloraError(f"adapter {name!r} requested but the engine has no adapter pager")
        if req.has_pin:
            return self.slots.is_ready(name)
        if name not in self._adapter_users:
            if len(self._adapter_users) >= self.max_adapters:
                return None
            if not is_starving and not self.slots.can_place(name):
                return None
        slot = self.slots.acquire(name)
        req.has_pin = True
        self._adapter_users[name] += 1
        return slot

    def _admit(self, req: Request, slot: int) -> None:
        self.waiting.remove(req)
        req.row = heapq.heappop(self._free_rows)
        req.slot = slot
        req.phase = Phase.PREFILL
        req.num_prefilled = 0
        self.running[req.row] = req
