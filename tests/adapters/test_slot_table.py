"""The slot table alone: plain Python, no JAX."""

from __future__ import annotations

import pytest

from jaxlora.adapters.slot_table import SlotTable


def test_free_slots_first_then_lru_unpinned():
    table = SlotTable(4)  # slots 1..3
    assert [table.assign(n) for n in "abc"] == [(1, None), (2, None), (3, None)]
    table.touch("a")  # LRU order now b, c, a
    assert table.assign("d") == (2, "b")
    table.pin("c")
    assert table.assign("e") == (1, "a")  # c is pinned, a is the oldest unpinned
    table.check()


def test_pinned_slots_are_never_evicted():
    table = SlotTable(3)
    for n in "ab":
        table.assign(n)
        table.pin(n)
    assert not table.can_assign()
    assert table.assign("c") is None
    table.unpin("a")
    assert table.assign("c") == (1, "a")
    table.check()


def test_exclude_protects_names():
    table = SlotTable(3)
    table.assign("a")
    table.assign("b")
    assert table.assign("c", exclude={"a", "b"}) is None
    assert table.assign("c", exclude={"a"}) == (2, "b")


def test_refcount_lives_without_a_slot_and_free_refuses_pinned():
    table = SlotTable(2)
    assert table.pin("x") == 1 and table.pin("x") == 2
    assert table.slot_of("x") is None
    table.assign("x")
    with pytest.raises(ValueError, match="pinned"):
        table.free("x")
    table.unpin("x")
    table.unpin("x")
    with pytest.raises(ValueError, match="not pinned"):
        table.unpin("x")
    assert table.free("x") == 1 and table.num_free == 1
    table.check()


def test_slot_zero_is_never_handed_out():
    table = SlotTable(2)
    assert table.assign("a") == (1, None)
    with pytest.raises(ValueError, match="already holds"):
        table.assign("a")
    with pytest.raises(ValueError, match="must be >= 2"):
        SlotTable(1)
