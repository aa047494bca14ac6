"""KV page bookkeeping: random grow/free sequences against a model of who owns what.

Invariants after every step: no page is leaked or shared between live sequences, a sequence holds
exactly the pages its length needs (never fewer, and it only grows), and a refused grow changes nothing.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxlora.engine.kv_pages import PageTable, pages_for

NUM_PAGES, PAGE_SIZE, MAX_PAGES = 12, 4, 5
SEQS = st.integers(0, 5)


class PageMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = PageTable(NUM_PAGES, PAGE_SIZE, MAX_PAGES)
        self.length: dict[int, int] = {}  # positions each live sequence asked for

    @rule(seq=SEQS, grow_by=st.integers(1, 9))
    def grow(self, seq: int, grow_by: int) -> None:
        target = self.length.get(seq, 0) + grow_by
        before = list(self.table.pages_of(seq))
        if self.table.can_grow(seq, target):
            self.table.grow(seq, target)
            self.length[seq] = target
            assert self.table.pages_of(seq)[: len(before)] == before  # pages never move
        else:
            with pytest.raises(RuntimeError):
                self.table.grow(seq, target)
            assert self.table.pages_of(seq) == before

    @rule(seq=SEQS)
    def free(self, seq: int) -> None:
        held = len(self.table.pages_of(seq))
        assert self.table.free(seq) == held
        self.length.pop(seq, None)

    @invariant()
    def no_page_leaked_or_shared(self) -> None:
        self.table.check()
        owned = [p for seq in self.length for p in self.table.pages_of(seq)]
        assert len(owned) == len(set(owned)) and len(owned) + self.table.num_free == NUM_PAGES

    @invariant()
    def each_sequence_holds_what_its_length_needs(self) -> None:
        for seq, length in self.length.items():
            assert len(self.table.pages_of(seq)) == pages_for(length, PAGE_SIZE) <= MAX_PAGES


TestPageTable = PageMachine.TestCase


def test_reserve_and_limits():
    table = PageTable(4, 4, max_pages_per_seq=3)
    assert table.can_grow(0, 12) and not table.can_grow(0, 13)  # the block table holds 3 pages
    assert not table.can_grow(0, 12, reserve=2) and table.can_grow(0, 8, reserve=2)
    with pytest.raises(ValueError):
        PageTable(0, 4, 1)
