"""KV page bookkeeping: random grow/free/register/attach sequences, and adapters taking and giving
back pages from the same pool (S-LoRA's unified pages), against a model of who owns what.

Invariants after every step: no page is leaked, a page is shared only by sequences that attached it
from the cache, a sequence holds exactly the pages its length needs (never fewer, and it only grows),
every keyed page holds what its key names, and a refused grow changes nothing.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxlora.engine.kv_pages import PageTable, pages_for

NUM_PAGES, PAGE_SIZE, MAX_PAGES = 12, 4, 5
SEQS = st.integers(0, 5)
OWNERS = st.sampled_from(["adapter-a", "adapter-b"])


def _key(contents: list[int]) -> bytes:
    """The key of the last page of `contents` (page labels from the first): names the whole prefix."""
    return repr(tuple(contents)).encode()


class PageMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = PageTable(NUM_PAGES, PAGE_SIZE, MAX_PAGES)
        self.length: dict[int, int] = {}  # positions each live sequence asked for
        self.contents: dict[int, list[int]] = {}  # a label per page a sequence holds: what it wrote there
        self.labels = itertools.count()
        self.registered: list[list[int]] = []  # contents whose full pages were keyed
        self.adapters: dict[str, list[int]] = {}  # pages each adapter was given, oldest first
        self.table.set_reclaimer(self)  # sequences may take idle adapters' pages: every adapter here is idle
        self.reclaimed = 0

    # The reclaimer (the unified pager's part): the oldest adapter goes first.
    def reclaimable_pages(self) -> int:
        return sum(len(p) for p in self.adapters.values())

    def reclaim(self) -> None:
        owner = next(iter(self.adapters))
        assert self.table.give_back(owner) == len(self.adapters.pop(owner))
        self.reclaimed += 1

    @rule(seq=SEQS, grow_by=st.integers(1, 9))
    def grow(self, seq: int, grow_by: int) -> None:
        target = self.length.get(seq, 0) + grow_by
        before = list(self.table.pages_of(seq))
        if self.table.can_grow(seq, target):
            self.table.grow(seq, target)
            self.length[seq] = target
            assert self.table.pages_of(seq)[: len(before)] == before  # pages never move
            new = len(self.table.pages_of(seq)) - len(before)
            self.contents.setdefault(seq, []).extend(next(self.labels) for _ in range(new))
        else:
            with pytest.raises(RuntimeError):
                self.table.grow(seq, target)
            assert self.table.pages_of(seq) == before

    @rule(seq=SEQS)
    def free(self, seq: int) -> None:
        held = len(self.table.pages_of(seq))
        assert self.table.free(seq) == held
        self.length.pop(seq, None)
        self.contents.pop(seq, None)

    @rule(seq=SEQS)
    def register(self, seq: int) -> None:
        full = self.length.get(seq, 0) // PAGE_SIZE
        contents = self.contents.get(seq, [])[:full]
        self.table.register(seq, [_key(contents[: i + 1]) for i in range(full)], 0, full)
        if full:
            self.registered.append(contents)

    @rule(seq=SEQS, which=st.integers(0, 20), num=st.integers(1, MAX_PAGES))
    def attach(self, seq: int, which: int, num: int) -> None:
        if seq in self.length or not self.registered:
            return
        contents = self.registered[which % len(self.registered)][:num]
        cached = self.table.lookup([_key(contents[: i + 1]) for i in range(len(contents))])
        if not cached or not self.table.can_admit(cached, len(cached) * PAGE_SIZE):
            return
        free = self.table.num_free
        self.table.attach(seq, cached)
        assert self.table.num_free >= free - len(cached)
        self.length[seq] = len(cached) * PAGE_SIZE
        self.contents[seq] = contents[: len(cached)]

    @rule(owner=OWNERS, num=st.integers(1, 6))
    def take_for_adapter(self, owner: str, num: int) -> None:
        if owner in self.adapters or num > self.table.num_takeable:  # owners never reclaim each other
            free = self.table.num_free
            with pytest.raises(RuntimeError):
                self.table.take_for(owner, num)
            assert self.table.num_free == free and self.table.owned(owner) == self.adapters.get(owner, [])
            return
        held = {p for seq in self.length for p in self.table.pages_of(seq)}
        pages = self.table.take_for(owner, num).tolist()
        assert len(set(pages)) == num and not set(pages) & held  # never a sequence's page
        assert all(self.table.key_of(p) is None for p in pages)  # an evicted cached page loses its key
        self.adapters[owner] = pages

    @rule(owner=OWNERS)
    def give_back(self, owner: str) -> None:
        assert self.table.give_back(owner) == len(self.adapters.pop(owner, []))

    @invariant()
    def idle_adapters_count_as_free(self) -> None:
        assert self.table.num_free == self.table.num_takeable + self.reclaimable_pages()

    @invariant()
    def no_page_leaked_and_only_cached_pages_shared(self) -> None:
        self.table.check()
        owned = [p for seq in self.length for p in self.table.pages_of(seq)]
        adapters = [p for pages in self.adapters.values() for p in pages]
        assert not set(adapters) & set(owned)
        assert self.table.num_owned == len(adapters)
        assert len(set(owned)) + len(adapters) + self.table.num_takeable == NUM_PAGES
        shared = {p for p in owned if owned.count(p) > 1}
        assert all(self.table.key_of(p) is not None for p in shared)

    @invariant()
    def each_sequence_holds_what_its_length_needs(self) -> None:
        for seq, length in self.length.items():
            assert len(self.table.pages_of(seq)) == pages_for(length, PAGE_SIZE) <= MAX_PAGES

    @invariant()
    def a_keyed_page_holds_what_its_key_names(self) -> None:
        for seq, contents in self.contents.items():
            for i, page in enumerate(self.table.pages_of(seq)):
                assert self.table.key_of(page) in (None, _key(contents[: i + 1]))


TestPageTable = PageMachine.TestCase


def test_reserve_and_limits():
    table = PageTable(4, 4, max_pages_per_seq=3)
    assert table.can_grow(0, 12) and not table.can_grow(0, 13)  # the block table holds 3 pages
    assert not table.can_grow(0, 12, reserve=2) and table.can_grow(0, 8, reserve=2)
    with pytest.raises(ValueError):
        PageTable(0, 4, 1)


class _Idle:
    """A reclaimer whose owners are all idle, the oldest reclaimed first."""

    def __init__(self, table: PageTable) -> None:
        self.table, self.owners, self.calls, self.asked = table, [], 0, 0

    def reclaimable_pages(self) -> int:
        self.asked += 1
        return sum(len(self.table.owned(o)) for o in self.owners)

    def reclaim(self) -> None:
        self.calls += 1
        self.table.give_back(self.owners.pop(0))


def test_growth_takes_free_then_cached_then_idle_owners_pages():
    table = PageTable(6, PAGE_SIZE, 6)
    idle = _Idle(table)
    table.set_reclaimer(idle)
    table.grow(0, 4)  # page for a prefix, keyed then freed: cached
    table.register(0, [b"prefix"], 0, 1)
    table.free(0)
    for owner in ("old", "new"):
        table.take_for(owner, 2)
        idle.owners.append(owner)
    assert table.num_takeable == 2 and table.num_free == 6  # 1 free + 1 cached + 4 owned by idle owners
    table.grow(1, 4)  # the free page
    assert idle.calls == 0 and table.num_cached == 1
    table.grow(1, 8)  # the cached page, before any owner
    assert idle.calls == 0 and table.num_cached == 0 and table.num_evictions == 1
    table.grow(1, 12)  # now the oldest idle owner's pages
    assert idle.calls == 1 and idle.owners == ["new"] and not table.owned("old")
    with pytest.raises(RuntimeError):
        table.take_for("third", 2)  # an owner never reclaims another: 1 free page only
    table.check()


def test_admission_checks_ask_the_reclaimer_only_when_free_pages_fall_short():
    """Every running sequence checks its growth each step: free and cached pages answer it without
    a walk over the reclaimer's owners, unless they fall short."""
    table = PageTable(8, PAGE_SIZE, 8)
    idle = _Idle(table)
    table.set_reclaimer(idle)
    table.take_for("adapter", 4)
    idle.owners.append("adapter")
    assert table.can_grow(0, 16) and table.can_admit([], 16, reserve=0)  # 4 free pages suffice
    assert idle.asked == 0
    assert table.can_grow(0, 20) and table.can_admit([], 32)  # 5 and 8 pages: the adapter's count
    assert idle.asked == 2
    assert not table.can_grow(0, 36)
