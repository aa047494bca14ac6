"""Random sequences of pager calls against a small model of what must hold.

The model tracks only what the contract promises: which names are registered, each name's pins, and
the slot a pinned adapter holds once it has one. Invariants checked after every step:
  - a pinned adapter never leaves (or changes) its slot;
  - no slot holds two adapters, slot 0 holds none;
  - every ready adapter's bank entries equal its host copy, and free slots are zero once committed;
  - after a commit every pinned adapter is ready or waiting, and it waits only if every slot is pinned.
"""

from __future__ import annotations

import collections

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxlora.adapters import Pager
from jaxlora.errors import AdapterError, AdapterInUseError, UnknownAdapterError
from tests.factories import random_adapters, tiny_config, tiny_lora

MODEL = tiny_config(num_layers=1)
# Three usable slots for eight names: plenty of eviction and waiting; ranks 1-8 span both rank
# classes of R = 8 (4 and 8), so small host copies are widened over slots that held large ones.
LORA = tiny_lora(max_slots=4, max_rank=8)
ADAPTERS = {a.name: a for a in random_adapters(8, MODEL, LORA, seed=3)}
NAMES = st.sampled_from(sorted(ADAPTERS))


class PagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pager = Pager(MODEL, LORA)
        self.registered: set[str] = set()
        self.pins: collections.Counter[str] = collections.Counter()
        self.pinned_slot: dict[str, int] = {}  # slot first seen for a pinned adapter

    @rule(name=NAMES)
    def register(self, name):
        if name in self.registered:
            with np.testing.assert_raises(AdapterError):
                self.pager.register(name, ADAPTERS[name])
        else:
            self.pager.register(name, ADAPTERS[name])
            self.registered.add(name)

    @rule(name=NAMES)
    def unregister(self, name):
        if name not in self.registered:
            with np.testing.assert_raises(UnknownAdapterError):
                self.pager.unregister(name)
        elif self.pins[name]:
            with np.testing.assert_raises(AdapterInUseError):
                self.pager.unregister(name, wait=False)
        else:
            self.pager.unregister(name, wait=False)
            self.registered.discard(name)

    @rule(name=NAMES)
    def acquire(self, name):
        if name not in self.registered:
            with np.testing.assert_raises(UnknownAdapterError):
                self.pager.acquire(name)
            return
        slot = self.pager.acquire(name)
        self.pins[name] += 1
        assert slot == self.pager.is_ready(name)

    @precondition(lambda self: +self.pins)
    @rule(data=st.data())
    def release(self, data):
        name = data.draw(st.sampled_from(sorted(+self.pins)))
        self.pager.release(name)
        self.pins[name] -= 1
        if not self.pins[name]:
            self.pinned_slot.pop(name, None)

    @rule(names=st.lists(NAMES, max_size=4))
    def prefetch(self, names):
        self.pager.prefetch(names)

    @rule()
    def stage(self):
        ready = {n: self.pager.is_ready(n) for n in self.registered}
        self.pager.stage()  # starts copies only: nothing becomes ready or changes slot
        assert ready == {n: self.pager.is_ready(n) for n in self.registered}

    @rule()
    def commit(self):
        self.pager.commit()
        snap = self.pager.snapshot()
        assert not snap["pending"]
        for name in +self.pins:
            assert self.pager.is_ready(name) is not None or name in snap["waiting"]
        if snap["waiting"]:
            assert all(self.pins[n] for n in snap["resident"]), "an adapter waits while a slot is unpinned"
        resident = snap["resident"]
        for slot in range(1, LORA.max_slots):
            if slot not in resident.values():
                assert_zero(self.pager, slot)

    @invariant()
    def bookkeeping_is_consistent(self):
        self.pager.check()
        resident = self.pager.snapshot()["resident"]
        assert len(set(resident.values())) == len(resident) and 0 not in resident.values()
        assert set(resident) <= self.registered
        assert {i.name: i.in_flight for i in self.pager.list()} == {n: self.pins[n] for n in self.registered}

    @invariant()
    def pinned_adapters_keep_their_slot(self):
        for name in +self.pins:
            slot = self.pager.slot_of(name)
            if name in self.pinned_slot:
                assert slot == self.pinned_slot[name], f"pinned {name} moved from {self.pinned_slot[name]}"
            elif slot is not None:
                self.pinned_slot[name] = slot

    @invariant()
    def ready_adapters_match_their_host_copy(self):
        for name in self.registered:
            slot = self.pager.is_ready(name)
            if slot is not None:
                jax.tree_util.tree_map(
                    lambda full, host: np.testing.assert_array_equal(full[:, slot], host),
                    jax.device_get(self.pager.bank),
                    self.pager.host_entries(name),
                )


def assert_zero(pager: Pager, slot: int) -> None:
    for full in jax.tree_util.tree_leaves(jax.device_get(pager.bank)):
        assert not np.any(full[:, slot]), f"free slot {slot} is not zero"


PagerMachine.TestCase.settings = hypothesis.settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
TestPager = PagerMachine.TestCase
