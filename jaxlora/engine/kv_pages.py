"""Which KV pages each sequence owns, and which pages hold a cached prefix: plain bookkeeping over
integer page ids, no JAX.

The device KV cache is one pool of `num_pages` pages of `page_size` positions each
(`jaxlora.model.kv_cache.PagedKVCache`). A sequence's position p lives in page
`pages_of(seq)[p // page_size]` at offset `p % page_size`; its pages need not be contiguous or in
order in the pool. A sequence takes pages as it grows (`grow`) and gives all of them back when it
finishes, is cancelled, fails or is preempted (`free`).

Prefix caching (vLLM's block hashing): a full page whose contents the caller names by a key
(`register`: a hash of the parent page's key, the page's token ids and the adapter's identity, see
`jaxlora.engine.prefix_hash`) can be shared. `lookup` finds the pages of the longest cached chain of
keys, and `attach` gives them to a new sequence before it grows. Pages are reference counted; a
keyed page that no sequence holds any longer stays cached (its contents intact) in an LRU list and
counts as free: `grow` takes never-keyed free pages first, then evicts the least recently freed
cached page (forgetting its key). A sequence only ever writes positions past the pages it attached,
so a shared page is never written while shared.

Adapter weights (S-LoRA's unified pool, `jaxlora.lora.unified_layout`) take whole pages from the
same free list: `take_for(owner, n)` gives an owner (an adapter's name) n pages, all or nothing,
evicting cached prefix pages as `grow` does (never a sequence's page), and `give_back(owner)`
returns them. So KV and adapters trade memory page by page. The other way, a `Reclaimer` (the
unified pager) offers the pages of idle adapters to sequences: they count as free, and `grow` takes
never-keyed free pages, then cached ones, then asks the reclaimer to evict an idle adapter.

Every page is exactly one of: free, cached (keyed, no holder), held by its reference count of
sequences, or owned by one owner; a key names at most one page. `check()` verifies all of it.

Memory follows actual lengths: admission asks `can_grow`/`can_admit`, not whether a
`max_seq_len` row is free.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Reclaimer(Protocol):
    """Owner-held pages that sequences may take back (idle adapters'): the unified pager."""

    def reclaimable_pages(self) -> int:
        """Pages `reclaim` could free now (cheap: called on every admission check)."""
        ...

    def reclaim(self) -> None:
        """Evicts one idle owner, giving its pages back through `PageTable.give_back`."""
        ...


def pages_for(num_positions: int, page_size: int) -> int:
    """Pages needed to hold positions [0, num_positions)."""
    return -(-num_positions // page_size)


class PageTable:
    """Page ids per sequence (keyed by an int, the engine's batch row), the free list and the
    cached pages (module doc).

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
        self._refs = [0] * num_pages  # sequences holding each page
        self._key_of: dict[int, bytes] = {}  # keyed page -> its key
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # no holder, LRU first
        self._owned: dict[str, list[int]] = {}  # pages taken for non-sequence owners (adapters)
        self._num_owned = 0  # their count: read by metrics threads, never an iteration over _owned
        self._reclaimer: Reclaimer | None = None
        self.num_evictions = 0

    # Queries.
    @property
    def num_free(self) -> int:
        """Pages a sequence may take: never-keyed free pages, cached ones and idle owners' (both
        evicted on demand)."""
        reclaimable = self._reclaimer.reclaimable_pages() if self._reclaimer is not None else 0
        return len(self._free) + len(self._cached) + reclaimable

    @property
    def num_takeable(self) -> int:
        """Pages `take_for` may take: free and cached ones (owners never evict each other here)."""
        return len(self._free) + len(self._cached)

    def set_reclaimer(self, reclaimer: Reclaimer | None) -> None:
        """Lets sequences take idle owners' pages through `reclaimer` (module doc)."""
        self._reclaimer = reclaimer

    @property
    def num_cached(self) -> int:
        """Keyed pages no sequence holds (kept for later hits until their memory is needed)."""
        return len(self._cached)

    @property
    def num_owned(self) -> int:
        """Pages taken by owners other than sequences (adapter weights); safe to read from any thread."""
        return self._num_owned

    def owned(self, owner: str) -> list[int]:
        """The pages `owner` holds, in the order taken (empty if none)."""
        return list(self._owned.get(owner, []))

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
        return self._has_free(self.pages_to_grow(seq, num_positions) + reserve)

    def _has_free(self, num: int) -> bool:
        """num <= num_free, asking the reclaimer (a walk over its owners) only when free and cached
        pages fall short: every running sequence asks once a step, and almost always needs 0 or 1."""
        return num <= len(self._free) + len(self._cached) or num <= self.num_free

    def key_of(self, page: int) -> bytes | None:
        """The key of a page's contents, if it is keyed."""
        return self._key_of.get(page)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `keys`, from the first, that are all cached or held."""
        found = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            found.append(page)
        return found

    def can_admit(self, cached: Sequence[int], num_positions: int, *, reserve: int = 0) -> bool:
        """Whether a new sequence that attaches `cached` (from `lookup`) can then grow to
        num_positions and leave `reserve` pages free: cached pages no sequence holds leave the
        free count when attached."""
        num = pages_for(num_positions, self.page_size)
        if num > self.max_pages_per_seq:
            return False
        unheld = sum(not self._refs[p] for p in cached)
        return self._has_free(max(0, num - len(cached)) + unheld + reserve)

    # Mutations.
    def attach(self, seq: int, cached: Sequence[int]) -> None:
        """Gives a sequence holding no pages the cached pages `cached` (from `lookup`), as its first."""
        if self.pages_of(seq):
            raise RuntimeError(f"sequence {seq} holds pages: cached pages go only to a new sequence")
        if not cached:
            return
        for page in cached:
            if page not in self._key_of:
                raise RuntimeError(f"page {page} holds no cached prefix")
            if not self._refs[page]:
                del self._cached[page]
            self._refs[page] += 1
        self._pages[seq] = list(cached)
        self._set_held(seq, len(cached))

    def grow(self, seq: int, num_positions: int) -> None:
        """Takes pages until the sequence holds positions [0, num_positions). Raises RuntimeError when
        the pool or the sequence's block table is out of pages (callers ask `can_grow` first)."""
        need = self.pages_to_grow(seq, num_positions)
        if not need:
            return
        if not self.can_grow(seq, num_positions):
            raise RuntimeError(
                f"sequence {seq} cannot grow to {num_positions} positions: {need} pages needed, {self.num_free} free"
            )
        pages = self._pages.setdefault(seq, [])
        for _ in range(need):
            page = self._take()
            self._refs[page] = 1
            pages.append(page)
        self._set_held(seq, len(pages))

    def take_for(self, owner: str, num: int) -> np.ndarray:
        """`num` pages for `owner` (which holds none yet), int32 [num]: free pages first, then cached
        ones, least recently used first. RuntimeError, nothing taken, if fewer are free."""
        if owner in self._owned:
            raise RuntimeError(f"{owner!r} holds pages already")
        if num < 1 or num > self.num_takeable:
            raise RuntimeError(f"{owner!r} asks for {num} pages; {self.num_takeable} of {self.num_pages} are free")
        pages = [self._take(reclaim=False) for _ in range(num)]
        self._owned[owner] = pages
        self._num_owned += num
        return np.asarray(pages, np.int32)

    def give_back(self, owner: str) -> int:
        """Frees every page `owner` holds (its contents are dead: no key); returns how many."""
        pages = self._owned.pop(owner, [])
        self._free.extend(reversed(pages))
        self._num_owned -= len(pages)
        return len(pages)

    def register(self, seq: int, keys: Sequence[bytes], start: int, stop: int) -> None:
        """Keys the sequence's pages [start, stop) with keys[start:stop] (each a full page whose
        contents the key names), so later sequences can attach them. A page keyed already keeps its
        key; a key that names another page already is left off (the same prefix computed twice)."""
        pages = self.pages_of(seq)
        if stop > min(len(pages), len(keys)):
            raise RuntimeError(f"sequence {seq} holds {len(pages)} pages and {len(keys)} keys, not {stop}")
        for i in range(start, stop):
            page, key = pages[i], keys[i]
            if page in self._key_of or key in self._page_of:
                continue
            self._key_of[page] = key
            self._page_of[key] = page

    def free(self, seq: int) -> int:
        """Gives back every page of the sequence; returns how many. A keyed page nobody holds any
        longer is cached, the sequence's last pages least recent (evicted first: a later sequence
        attaches a prefix, so the first pages are the likelier hits)."""
        pages = self._pages.pop(seq, [])
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page]:
                continue
            if page in self._key_of:
                self._cached[page] = None
            else:
                self._free.append(page)
        if pages:
            self._set_held(seq, 0)
        return len(pages)

    def forget_cached(self) -> None:
        """Drops every key (the pool's contents were lost): cached pages become plain free pages."""
        self._free.extend(self._cached)
        self._cached.clear()
        self._key_of.clear()
        self._page_of.clear()

    def _take(self, *, reclaim: bool = True) -> int:
        # reclaim=False for owners (`take_for`): the reclaimer is the owners' pager, which calls
        # take_for under its own lock; reclaiming from there would wait on that lock for good.
        if self._free:
            return self._free.pop()
        if reclaim and not self._cached and self._reclaimer is not None:
            self._reclaimer.reclaim()  # gives an idle owner's pages back to the free list
            if self._free:
                return self._free.pop()
        page, _ = self._cached.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.num_evictions += 1
        return page

    def _set_held(self, seq: int, count: int) -> None:
        if seq >= len(self._held):
            self._resize_held(max(seq + 1, 2 * len(self._held)))
        self._held[seq] = count

    def _resize_held(self, size: int) -> None:
        held = np.zeros(size, np.int32)
        held[: len(self._held)] = self._held
        self._held = held

    def check(self) -> None:
        """Raises RuntimeError if a page is lost, in two states, miscounted or out of range, or a key
        names two pages. A RuntimeError, not an `assert`: the invariants guard the cache's contents
        and must hold under `python -O` too."""
        holders = collections.Counter(p for pages in self._pages.values() for p in pages)
        held, free, cached = set(holders), set(self._free), set(self._cached)
        owned = [p for pages in self._owned.values() for p in pages]
        every = len(held) + len(self._free) + len(self._cached) + len(owned)
        if every != self.num_pages or held | free | cached | set(owned) != set(range(self.num_pages)):
            raise RuntimeError(
                f"page table corrupt: {len(held)} held + {len(self._free)} free + {len(self._cached)} cached "
                f"+ {len(owned)} owned != {self.num_pages} distinct pages"
            )
        if set(owned) & set(self._key_of):
            raise RuntimeError("page table corrupt: an owned page is keyed")
        if self._num_owned != len(owned):
            raise RuntimeError("page table corrupt: the owned page count disagrees with the owners' pages")
        if any(self._refs[p] != holders.get(p, 0) for p in range(self.num_pages)):
            raise RuntimeError("page table corrupt: a reference count disagrees with the sequences holding the page")
        if any(len(set(pages)) != len(pages) for pages in self._pages.values()):
            raise RuntimeError("page table corrupt: a sequence holds a page twice")
        if free & set(self._key_of) or not cached <= set(self._key_of):
            raise RuntimeError("page table corrupt: a free page is keyed, or a cached one is not")
        if len(self._page_of) != len(self._key_of) or any(self._page_of.get(k) != p for p, k in self._key_of.items()):
            raise RuntimeError("page table corrupt: the key maps disagree")
        if any(len(pages) > self.max_pages_per_seq for pages in self._pages.values()):
            raise RuntimeError("a sequence holds more pages than its block table")
        counted = {seq: int(n) for seq, n in enumerate(self._held.tolist()) if n}
        if counted != {seq: len(pages) for seq, pages in self._pages.items() if pages}:
            raise RuntimeError("page table corrupt: the per-sequence page counts disagree with the pages held")
