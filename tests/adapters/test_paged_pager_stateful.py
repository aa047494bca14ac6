"""`PagerMachine`'s random call sequences against the paged pager, with a pool too small for every
slot: evictions for pages as well as for slots. Beyond the padded pager's invariants (each step
ends with `PagedPager.check()`: no page with two owners, none lost), every ready adapter's pages,
read through its page-table rows in the pool of each factor's width, equal its host copy, and every
free slot has rank 0."""

from __future__ import annotations

import dataclasses

import hypothesis
import jax
import numpy as np
from hypothesis.stateful import invariant, rule

from jaxlora.adapters import PagedPager
from jaxlora.config import LoraBank
from jaxlora.lora.paged_bank import factor_width
from tests.adapters.test_pager_stateful import LORA, MODEL, PagerMachine

# Page rows of 2: ranks 1-8 take 1-4 pages per factor and module. 40 pages hold one full adapter
# (4 modules x 2 factors x 4 pages) and a few small ones, far from three slots at full rank.
PAGED = dataclasses.replace(LORA, bank=LoraBank.PAGED, page_rows=2, pool_pages=40)


class PagedPagerMachine(PagerMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pager = PagedPager(MODEL, PAGED)

    @rule()
    def commit(self):
        self.pager.commit()
        snap = self.pager.snapshot()
        assert not snap["pending"]
        for name in +self.pins:
            assert self.pager.is_ready(name) is not None or name in snap["waiting"]
        ranks = jax.device_get(self.pager.state["ranks"])
        for slot in set(range(1, PAGED.max_slots)) - set(snap["resident"].values()):
            assert all(r[slot] == 0 for r in ranks.values()), f"free slot {slot} has a rank"

    @invariant()
    def ready_adapters_match_their_host_copy(self):
        state = jax.device_get(self.pager.state)
        for name in self.registered:
            slot = self.pager.is_ready(name)
            if slot is None:
                continue
            adapter = self.pager.host_adapter(name)
            ids = {w: [] for w in state["pools"]}
            for m, r in adapter.module_ranks.items():
                assert state["ranks"][m][slot] == r
                per = -(-r // PAGED.page_rows)
                for f in range(2):
                    ids[factor_width(MODEL, m, f)] += [
                        int(p) for layer in range(MODEL.num_layers) for p in state["tables"][m][f, layer, slot, :per]
                    ]
            for w, pool in state["pools"].items():  # each factor's pages, in the pool of its width
                np.testing.assert_array_equal(pool[ids[w]], adapter.pages[w])


PagedPagerMachine.TestCase.settings = hypothesis.settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
TestPagedPager = PagedPagerMachine.TestCase
