"""PageAllocator: all-or-nothing allocation, no page handed out twice, double frees refused."""

import numpy as np
import pytest

from jaxlora.adapters.page_allocator import PageAllocator


def test_allocate_and_free_round_trip():
    pages = PageAllocator(10)
    a = pages.allocate(4)
    b = pages.allocate(6)
    assert sorted([*a, *b]) == list(range(10)) and pages.num_free == 0
    with pytest.raises(ValueError, match="1 pages asked for, 0 of 10 free"):
        pages.allocate(1)
    pages.free(a)
    assert pages.num_free == 4 and pages.num_taken == 6
    assert sorted(pages.allocate(4)) == sorted(a)
    pages.check()


def test_a_failed_allocation_takes_nothing_and_double_frees_are_refused():
    pages = PageAllocator(3)
    ids = pages.allocate(2)
    with pytest.raises(ValueError):
        pages.allocate(2)
    assert pages.num_free == 1
    pages.free(ids)
    with pytest.raises(ValueError, match="not taken"):
        pages.free(ids[:1])
    with pytest.raises(ValueError, match="not taken"):
        pages.free(np.asarray([7]))
    with pytest.raises(ValueError):
        PageAllocator(0)
    pages.check()
