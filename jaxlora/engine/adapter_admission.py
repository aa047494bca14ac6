"""Which device slot a request may run on: adapter pins, the per-batch adapter cap, and the slot a
step may read. Plain Python, no JAX; the scheduler asks it, and it alone touches the adapter source.

A request holds at most one pin of its adapter (`pin`, undone by `release`), taken while it waits so
that the page-in is queued before the pager stages its copies. Its slot (`slot`) is the one a step
dispatched after the pager's next commit may read: written already, or written by that commit
(`staged`). Base-model requests need no pin and run on `BASE_SLOT`.
"""

from __future__ import annotations

import collections
import typing
from typing import TYPE_CHECKING

from jaxlora.engine.prefix_hash import BASE_IDENTITY
from jaxlora.errors import JaxloraError

if TYPE_CHECKING:  # importable without JAX
    from jaxlora.adapters.source import AdapterSource
    from jaxlora.engine.request import Request

BASE_SLOT = 0


class SlotOf(typing.NamedTuple):
    """slot: the slot a step may read (None: not yet); staged: only after the pager's next commit."""

    slot: int | None
    staged: bool = False


class AdapterAdmission:
    """Pins and slots over the adapter source `slots` (None: base model only).

    Args:
      max_adapters_per_batch: distinct adapters pinned at once (None: every slot of `slots` but
        the base slot).
    """

    def __init__(self, slots: AdapterSource | None, max_adapters_per_batch: int | None) -> None:
        if max_adapters_per_batch is None:
            max_adapters_per_batch = 0 if slots is None else slots.max_slots - 1
        self.slots = slots
        self.max_adapters_per_batch = max_adapters_per_batch
        self._users: collections.Counter[str] = collections.Counter()  # pins per adapter

    def active(self) -> set[str]:
        """Adapters pinned by running or waiting requests (the batch's distinct adapters)."""
        return set(self._users)

    def slot(self, req: Request) -> SlotOf:
        """The request's slot if a step dispatched after the pager's next commit may read it; None
        while its adapter is not pinned or not there."""
        if req.adapter is None:
            return SlotOf(BASE_SLOT)
        if not req.has_pin:
            return SlotOf(None)
        slot = self.slots.is_ready(req.adapter)
        if slot is not None:
            return SlotOf(slot)
        slot = self.slots.slot_at_commit(req.adapter)
        return SlotOf(slot, slot is not None)

    @staticmethod
    def identity(req: Request) -> bytes:
        """The identity of the weights the request runs on (the root of its prefix-cache keys), read
        when its pin was taken: the weights it runs on cannot change while it holds the pin."""
        if req.adapter is None:
            return BASE_IDENTITY
        if req.weights_identity is None:
            raise RuntimeError(f"request {req.request_id} asks its adapter's identity without a pin")
        return req.weights_identity

    def pin(self, req: Request, *, is_starving: bool) -> bool:
        """Pins the request's adapter if it holds no pin yet (within the cap on distinct adapters and,
        unless starving, only if the pager can place it without waiting); returns whether the adapter
        has a slot (written, or its page-in queued). Raises JaxloraError for an adapter that is gone."""
        name = req.adapter
        if name is None:
            return True
        if self.slots is None:
            raise JaxloraError(f"adapter {name!r} requested but the engine has no adapter pager")
        if not req.has_pin:
            if name not in self._users:
                if len(self._users) >= self.max_adapters_per_batch:
                    return False
                if not is_starving and not self.slots.can_place(name):
                    return False
            self.slots.acquire(name)
            req.weights_identity = self.slots.identity(name)  # pinned: the registration stays
            req.has_pin = True
            self._users[name] += 1
        return self.slots.slot_of(name) is not None

    def release(self, req: Request) -> None:
        """Gives back the request's pin, if it holds one."""
        if not req.has_pin:
            return
        req.has_pin = False
        self._users[req.adapter] -= 1
        if not self._users[req.adapter]:
            del self._users[req.adapter]
        self.slots.release(req.adapter)
