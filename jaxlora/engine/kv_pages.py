"""Which KV pages each sequence owns: plain bookkeeping over integer page ids, no JAX.

The device KV cache is one pool of `num_pages` pages of `page_size` positions each
(`jaxlora.model.kv_cache.PagedKVCache`). A sequence's position p lives in page
`pages_of(seq)[p // page_size]` at offset `p % page_size`; its pages need not be contiguous or in
order in the pool. A sequence takes pages as it grows (`grow`) and returns all of them when it
finishes, is cancelled, fails or is preempted (`free`). A page belongs to at most one live
sequence, and every page is either free or owned: `check()` verifies both.

Memory follows actual lengths: admission asks `can_grow`, not whether a `max_seq_len` row is free.
"""

from __future__ import annotations

import numpy as np


def pages_for(num_positions: int, page_size: int) -> int:
    """Pages needed to hold positions [0, num_positions)."""
    return -(-num_positions // page_size)


class PageTable:
    """Page ids per sequence (keyed by an int, the engine's batch row), and the free list.

    Not thread-safe: the engine loop owns it.
    """

    def __init__(self, num_pages: int, page_size: int, max_pages_per_seq: int) -> None:
        if num_pages < 1 or page_size < 1 or max_pages_per_seq < 1:
            raise ValueError(f"{num_pages=}, {page_size=} and {max_pages_per_seq=} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        # Handing out the most recently freed page first keeps the working set of the pool small.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}
        # Pages held per sequence id, for reading many sequences at once (`held`): the packer checks
        # every row of a step for new pages, and a numpy gather does that without a loop over rows.
        self._held = np.zeros(0, np.int32)

    # Queries.
    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_of(self, seq: int) -> list[int]:
        return self._pages.get(seq, [])

    def held(self, seqs: np.ndarray) -> np.ndarray:
        """Pages held by each of `seqs` (sequence ids >= 0, an int array), as an int32 array."""
        if len(seqs) and int(seqs.max()) >= len(self._held):
            self._resize_held(int(seqs.max()) + 1)
        return self._held[seqs]

    def capacity(self, seq: int) -> int:
        """Positions the sequence can hold without taking another page."""
        return len(self.pages_of(seq)) * self.page_size

    def pages_to_grow(self, seq: int, num_positions: int) -> int:
        """Pages the sequence must take to hold positions [0, num_positions)."""
        return max(0, pages_for(num_positions, self.page_size) - len(self.pages_of(seq)))

    def can_grow(self, seq: int, num_positions: int, *, reserve: int = 0) -> bool:
        """Whether `grow(seq, num_positions)` would succeed and still leave `reserve` pages free."""
        if pages_for(num_positions, self.page_size) > self.max_pages_per_seq:
            return False
        return self.pages_to_grow(seq, num_positions) + reserve <= len(self._free)

    # Mutations.
    def grow(self, seq: int, num_positions: int) -> None:
        """Takes pages until the sequence holds positions [0, num_positions). Raises RuntimeError when
        the pool or the sequence's block table is out of pages (callers ask `can_grow` first)."""
        need = self.pages_to_grow(seq, num_positions)
        if not need:
            return
        if not self.can_grow(seq, num_positions):
            raise RuntimeError(
                f"sequence {seq} cannot grow to {num_positions} positions: {need} pages needed, {len(self._free)} free"
            )
        pages = self._pages.setdefault(seq, [])
        for _ in range(need):
            pages.append(self._free.pop())
        self._set_held(seq, len(pages))

    def free(self, seq: int) -> int:
        """Returns every page of the sequence to the pool; returns how many."""
        pages = self._pages.pop(seq, [])
        self._free.extend(reversed(pages))
        if pages:
            self._set_held(seq, 0)
        return len(pages)

    def _set_held(self, seq: int, count: int) -> None:
        if seq >= len(self._held):
            self._resize_held(max(seq + 1, 2 * len(self._held)))
        self._held[seq] = count

    def _resize_held(self, size: int) -> None:
        held = np.zeros(size, np.int32)
        held[: len(self._held)] = self._held
        self._held = held

    def check(self) -> None:
        """Raises RuntimeError if a page is lost, shared or out of range. A RuntimeError, not an
        `assert`: the invariant guards the cache's contents and must hold under `python -O` too."""
        owned = [p for pages in self._pages.values() for p in pages]
        every = owned + self._free
        if len(every) != self.num_pages or set(every) != set(range(self.num_pages)):
            raise RuntimeError(
                f"page table corrupt: {len(owned)} owned + {len(self._free)} free != {self.num_pages} distinct pages"
            )
        if any(len(pages) > self.max_pages_per_seq for pages in self._pages.values()):
            raise RuntimeError("a sequence holds more pages than its block table")
        counted = {seq: int(n) for seq, n in enumerate(self._held.tolist()) if n}
        if counted != {seq: len(pages) for seq, pages in self._pages.items() if pages}:
            raise RuntimeError("page table corrupt: the per-sequence page counts disagree with the pages held")
