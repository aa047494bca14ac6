"""Which pages of the paged adapter bank's pool are free: plain bookkeeping over integer ids, no JAX.

Pages are taken for one adapter at a time (`allocate`, all or nothing) and given back together
(`free`). Which adapter owns which pages, and whom to evict when too few are free, is the pager's
business (`jaxlora.adapters.paged_pager`); this only refuses to hand out a page twice.
"""

from __future__ import annotations

import numpy as np

from jaxlora.adapters.slot_table import invariant


class PageAllocator:
    """A free list over pages 0..num_pages-1. Not thread-safe: the pager calls it under its lock."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"{num_pages=} must be >= 1")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack: low ids are taken first
        self._taken: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_taken(self) -> int:
        return len(self._taken)

    def allocate(self, num: int) -> np.ndarray:
        """`num` free page ids, int32 [num]; ValueError (nothing taken) if fewer are free."""
        if num > len(self._free):
            raise ValueError(f"{num} pages asked for, {len(self._free)} of {self.num_pages} free")
        ids = [self._free.pop() for _ in range(num)]
        self._taken.update(ids)
        return np.asarray(ids, np.int32)

    def free(self, ids: np.ndarray) -> None:
        """Gives pages back; ValueError for a page that is not taken (a double free)."""
        ids = [int(i) for i in ids]
        stray = [i for i in ids if i not in self._taken]
        if stray or len(set(ids)) != len(ids):
            raise ValueError(f"pages {sorted(stray) or ids} are not taken (freed twice?)")
        self._taken.difference_update(ids)
        self._free.extend(sorted(ids, reverse=True))

    def check(self) -> None:
        """Raises RuntimeError naming the broken invariant if the free list is inconsistent (tests)."""
        invariant(len(set(self._free)) == len(self._free), "a page is free twice")
        invariant(not set(self._free) & self._taken, "a page is free and taken")
        invariant(len(self._free) + len(self._taken) == self.num_pages, "pages lost")
