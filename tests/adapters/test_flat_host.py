"""Registered adapters are one flat host buffer each; a page-in is one device_put and one jitted write."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.adapters import HostMemory, Pager
from jaxlora.adapters.registry import FlatLayout
from jaxlora.lora.bank import flat_slot_layout, init_bank, set_slot, slot_arrays, write_slot_flat, write_slots_flat
from tests.adapters.slots import assert_trees_equal, expected_entries
from tests.factories import random_adapter, random_adapters, tiny_config, tiny_lora

MODEL = tiny_config()


def varied_adapters(lora):
    """Different ranks (1..max) and module subsets, incl. a single module and every module."""
    rng = np.random.default_rng(7)
    out = random_adapters(6, MODEL, lora, seed=11)
    out.append(random_adapter("one-module", MODEL, rank=1, modules=("o_proj",), rng=rng))
    out.append(random_adapter("all-modules", MODEL, rank=lora.max_rank, modules=lora.target_modules, rng=rng))
    assert len({a.rank for a in out}) > 1 and len({a.target_modules for a in out}) > 1
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("host_memory", [HostMemory.PAGEABLE, HostMemory.PINNED])
def test_flat_host_buffer_round_trips(dtype, host_memory):
    lora = tiny_lora(target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    pager = Pager(MODEL, lora, dtype=dtype, host_memory=host_memory)
    adapters = varied_adapters(lora)
    for a in adapters:
        pager.register(a.name, a)
    assert pager.registered_bytes == len(adapters) * pager.slot_nbytes
    for a in adapters:
        stored = pager.host_adapter(a.name)
        flat = stored.flat
        # One contiguous 1-D buffer in the bank dtype, where the pager keeps host copies.
        assert flat.ndim == 1 and flat.dtype == np.dtype(dtype) and flat.size == pager.layout.size
        assert stored.nbytes == flat.nbytes == pager.slot_nbytes == pager.info(a.name).nbytes
        if host_memory is HostMemory.PINNED:
            assert isinstance(flat, jax.Array) and flat.sharding.memory_kind == "pinned_host"
        else:
            assert isinstance(flat, np.ndarray)
        assert stored.layout is pager.layout  # shared by every adapter of the bank
        assert_trees_equal(pager.host_entries(a.name), expected_entries(a, MODEL, lora, dtype))


@pytest.mark.parametrize("host_memory", [HostMemory.PAGEABLE, HostMemory.PINNED])
def test_page_in_writes_exactly_what_set_slot_writes(host_memory):
    lora = tiny_lora(max_slots=4, max_rank=4)
    pager = Pager(MODEL, lora, dtype=jnp.bfloat16, host_memory=host_memory)
    adapters = varied_adapters(lora)
    for a in adapters:
        pager.register(a.name, a)
    for a in adapters:  # 3 usable slots: later adapters evict earlier ones
        assert pager.acquire(a.name) is None
        pager.commit()
        slot = pager.is_ready(a.name)
        assert slot is not None
        reference = set_slot(init_bank(MODEL, lora, jnp.bfloat16), slot, expected_entries(a, MODEL, lora, jnp.bfloat16))
        got = jax.device_get(pager.bank)
        want = jax.device_get(reference)
        jax.tree_util.tree_map(lambda g, w: np.testing.assert_array_equal(g[:, slot], w[:, slot]), got, want)
        pager.release(a.name)
    pager.check()


def test_write_slot_flat_equals_set_slot_on_a_full_bank():
    """Every slot but the written one is untouched; the written one holds the unpacked entries."""
    lora = tiny_lora()
    rng = np.random.default_rng(0)
    bank = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), init_bank(MODEL, lora))
    layout = FlatLayout.for_bank(MODEL, lora, jnp.float32)
    assert layout.leaves == flat_slot_layout(bank)
    for a in varied_adapters(lora):
        flat = layout.pack(a.weights, MODEL, lora)
        assert_trees_equal(layout.unpack(flat), expected_entries(a, MODEL, lora, jnp.float32))
        copy = jax.tree_util.tree_map(jnp.copy, bank)  # both writes donate their bank
        want = jax.device_get(set_slot(jax.tree_util.tree_map(jnp.copy, bank), 3, slot_arrays(a.weights, MODEL, lora)))
        got = jax.device_get(write_slot_flat(copy, 3, jnp.asarray(flat)))
        assert_trees_equal(got, want)
    with pytest.raises(ValueError, match="slot 0"):
        write_slot_flat(bank, 0, jnp.asarray(layout.zeros()))


def test_write_slots_flat_equals_writes_one_by_one_in_order():
    """k writes in one call, a slot written twice included: the same bank as k single writes."""
    lora = tiny_lora(max_slots=6)
    rng = np.random.default_rng(1)
    bank = jax.tree_util.tree_map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), init_bank(MODEL, lora))
    layout = FlatLayout.for_bank(MODEL, lora, jnp.float32)
    flats = [jnp.asarray(layout.pack(a.weights, MODEL, lora)) for a in varied_adapters(lora)][:4]
    slots = [4, 2, 4, 5]
    assert len(flats) == len(slots)
    one_by_one = jax.tree_util.tree_map(jnp.copy, bank)
    for slot, flat in zip(slots, flats):
        one_by_one = write_slot_flat(one_by_one, slot, flat)
    together = write_slots_flat(jax.tree_util.tree_map(jnp.copy, bank), np.array(slots), tuple(flats))
    assert_trees_equal(jax.device_get(together), jax.device_get(one_by_one))
    with pytest.raises(ValueError, match="slot 0"):
        write_slots_flat(bank, np.array([1, 0]), tuple(flats[:2]))
    with pytest.raises(ValueError, match="one slot per flat"):
        write_slots_flat(bank, np.array([1, 2, 3]), tuple(flats[:2]))


def test_layout_pack_refuses_what_slot_arrays_refuses():
    lora = tiny_lora()
    layout = FlatLayout.for_bank(MODEL, lora, jnp.float32)
    rng = np.random.default_rng(0)
    too_big = random_adapter("big", MODEL, rank=lora.max_rank + 1, modules=("q_proj",), rng=rng)
    with pytest.raises(ValueError, match="rank"):
        layout.pack(too_big.weights, MODEL, lora)
    gate = random_adapter("gate", MODEL, rank=2, modules=("gate_proj",), rng=rng)
    with pytest.raises(ValueError, match="does not hold"):
        layout.pack(gate.weights, MODEL, lora)


@pytest.mark.parametrize("host_memory", [HostMemory.PAGEABLE, HostMemory.PINNED])
def test_one_device_put_per_page_in_and_no_compiles(monkeypatch, host_memory):
    pager = Pager(MODEL, tiny_lora(), host_memory=host_memory)
    adapters = random_adapters(5, MODEL, pager.lora_config, seed=2)
    for a in adapters:
        pager.register(a.name, a)
    flats = {id(pager.host_adapter(a.name).flat) for a in adapters}
    real_put = jax.device_put
    puts = []

    def counting_put(x, *args, **kwargs):
        puts.append(x)
        return real_put(x, *args, **kwargs)

    compiles = []

    def on_event(event, *_, **__):
        if "backend_compile" in event:
            compiles.append(event)

    monkeypatch.setattr(jax, "device_put", counting_put)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        with jax.no_tracing():
            for a in adapters[:3]:
                assert pager.acquire(a.name) is None
            pager.commit()  # three page-ins
            assert len(puts) == 3 and {id(x) for x in puts} <= flats  # the stored buffers themselves
            assert all(getattr(x, "ndim", None) == 1 for x in puts)  # one array each, not a pytree
            for a in adapters[:3]:
                pager.release(a.name)
            pager.unregister(adapters[0].name)
            puts.clear()
            pager.commit()  # the freed slot is zeroed: one put of the zero buffer
            assert len(puts) == 1 and puts[0].ndim == 1
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert not compiles


def test_timed_transfers_count_the_adapter_bytes():
    pager = Pager(MODEL, tiny_lora(), time_transfers=True)
    adapters = random_adapters(3, MODEL, pager.lora_config, seed=4)
    for a in adapters:
        pager.register(a.name, a)
        pager.acquire(a.name)
    pager.commit()
    m = pager.metrics
    assert len(m.transfer_seconds) == 3 and m.timed_bytes == 3 * pager.slot_nbytes and m.timed_seconds > 0
