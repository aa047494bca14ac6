"""Which adapter sits in which device slot: plain bookkeeping over integer ids, no JAX.

Slots 1..num_slots-1 hold adapters; slot 0 is the reserved all-zero base-model slot and never appears
here. Each name has a refcount (running requests pinned to it), kept whether or not it is resident,
because a request pins its adapter before the adapter has a slot. A resident name with refcount > 0
is pinned: `assign` never evicts it. Among unpinned residents, the least recently used goes first.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Container


class SlotTable:
    """slot <-> name, LRU order over resident names, refcount per name.

    Not thread-safe: the pager calls it under its lock.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"{num_slots=} must be >= 2 (slot 0 is the base model)")
        self.num_slots = num_slots
        self._free: list[int] = list(range(1, num_slots))  # a heap: lowest free slot first
        self._slot_of: dict[str, int] = {}
        self._name_in: dict[int, str] = {}
        self._lru: collections.OrderedDict[str, None] = collections.OrderedDict()  # oldest first
        self._refcount: collections.Counter[str] = collections.Counter()

    # Queries.
    def slot_of(self, name: str) -> int | None:
        return self._slot_of.get(name)

    def name_in(self, slot: int) -> str | None:
        return self._name_in.get(slot)

    def refcount(self, name: str) -> int:
        return self._refcount[name]

    def is_pinned(self, name: str) -> bool:
        return self._refcount[name] > 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pinned_slots(self) -> int:
        return sum(1 for name in self._slot_of if self._refcount[name] > 0)

    def resident(self) -> dict[str, int]:
        """name -> slot of every resident adapter."""
        return dict(self._slot_of)

    def resident_lru(self) -> list[str]:
        """Resident names, least recently used first."""
        return list(self._lru)

    def can_assign(self, exclude: Container[str] = ()) -> bool:
        """Whether `assign` would find a slot (free, or an unpinned resident not in `exclude`)."""
        return bool(self._free) or self._victim(exclude) is not None

    # Mutations.
    def pin(self, name: str) -> int:
        self._refcount[name] += 1
        self.touch(name)
        return self._refcount[name]

    def unpin(self, name: str) -> int:
        if self._refcount[name] <= 0:
            raise ValueError(f"adapter {name!r} is not pinned")
        self._refcount[name] -= 1
        if not self._refcount[name]:
            del self._refcount[name]
        self.touch(name)
        return self._refcount[name]

    def touch(self, name: str) -> None:
        """Marks a resident name as most recently used (no-op if not resident)."""
        if name in self._lru:
            self._lru.move_to_end(name)

    def assign(self, name: str, exclude: Container[str] = ()) -> tuple[int, str | None] | None:
        """Gives `name` a slot: a free one, else the LRU unpinned resident's (not one in `exclude`).

        Returns:
          (slot, evicted name or None), or None when every occupied slot is pinned or excluded.
        """
        if name in self._slot_of:
            raise ValueError(f"adapter {name!r} already holds slot {self._slot_of[name]}")
        evicted = None
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            evicted = self._victim(exclude)
            if evicted is None:
                return None
            slot = self._slot_of.pop(evicted)
            del self._lru[evicted]
        self._slot_of[name] = slot
        self._name_in[slot] = name
        self._lru[name] = None
        return slot, evicted

    def free(self, name: str) -> int | None:
        """Removes `name` from its slot (refused while pinned); returns the freed slot or None."""
        if self._refcount[name] > 0:
            raise ValueError(f"adapter {name!r} is pinned ({self._refcount[name]} users)")
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            del self._name_in[slot]
            del self._lru[name]
            heapq.heappush(self._free, slot)
        return slot

    def victim(self, exclude: Container[str] = ()) -> str | None:
        """The least recently used unpinned resident not in `exclude` (what `assign` would evict)."""
        return self._victim(exclude)

    def _victim(self, exclude: Container[str]) -> str | None:
        for name in self._lru:
            if self._refcount[name] == 0 and name not in exclude:
                return name
        return None

    def check(self) -> None:
        """Raises RuntimeError naming the broken invariant if the table is inconsistent (tests)."""
        invariant(set(self._slot_of) == set(self._lru), "LRU order and residents differ")
        invariant(all(self._name_in[s] == n for n, s in self._slot_of.items()), "slot maps disagree")
        invariant(len(self._name_in) == len(self._slot_of), "a slot holds two adapters")
        invariant(not set(self._free) & set(self._name_in), "a free slot is occupied")
        invariant(sorted(self._free + list(self._name_in)) == list(range(1, self.num_slots)), "slots lost")
        invariant(all(c > 0 for c in self._refcount.values()), "non-positive refcount")


def invariant(holds: bool, what: str) -> None:
    """Raises RuntimeError when a bookkeeping invariant does not hold."""
    # An exception, not `assert`: these checks must also run under `python -O`.
    if not holds:
        raise RuntimeError(f"slot bookkeeping broken: {what}")
