"""Host copies at the adapter's rank class: fewer host and host->device bytes, the same slot contents.

The reference for every written slot is `bank.slot_arrays` (padded straight to R from the adapter's
own weights), which shares nothing with the class layout, its packing or the device widening.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.adapters import HostMemory, Pager
from jaxlora.adapters.registry import FlatLayout, rank_class, rank_classes, slot_nbytes, widen_flat
from jaxlora.engine.compiles import backend_compiles
from jaxlora.errors import CapacityError
from jaxlora.lora.bank import widen_slot_entries
from jaxlora.lora.peft_format import save_peft_adapter
from tests.adapters.slots import assert_trees_equal, expected_entries
from tests.factories import random_adapter, tiny_config, tiny_lora

MODEL = tiny_config()
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = tiny_lora(max_rank=16, max_slots=4, target_modules=ALL_MODULES)  # classes 4, 8, 16


def mixed_rank_adapters(lora=LORA) -> list:
    """Every class's edges (1, 4, 5, 8, 9, 16) and module subsets: one module, a partial group, all."""
    rng = np.random.default_rng(3)
    cases = [
        (1, ("o_proj",)),
        (4, ("q_proj", "v_proj")),
        (5, ALL_MODULES),
        (8, ("gate_proj", "down_proj")),
        (9, ("k_proj", "up_proj", "o_proj")),
        (16, ALL_MODULES),
    ]
    return [random_adapter(f"r{r}-{i}", MODEL, rank=r, modules=m, rng=rng) for i, (r, m) in enumerate(cases)]


def bank_slot(pager: Pager, slot: int):
    return jax.tree_util.tree_map(lambda full: np.asarray(full[:, slot]), pager.bank)


@pytest.mark.parametrize(
    "max_rank, classes",
    [(64, (4, 8, 16, 32, 64)), (16, (4, 8, 16)), (12, (6, 12)), (8, (4, 8)), (4, (4,)), (3, (3,)), (1, (1,))],
)
def test_rank_classes_halve_down_to_the_minimum(max_rank, classes):
    assert rank_classes(max_rank) == classes


def test_rank_class_is_the_smallest_that_holds_the_rank():
    classes = rank_classes(16)
    assert [rank_class(r, classes) for r in (1, 4, 5, 8, 9, 15, 16)] == [4, 4, 8, 8, 16, 16, 16]
    with pytest.raises(ValueError, match="exceeds"):
        rank_class(17, classes)


@pytest.mark.parametrize("xp", [np, jnp], ids=["numpy", "jax"])
def test_widened_class_entries_equal_the_entries_padded_to_r(xp):
    layouts = FlatLayout.classes_for_bank(MODEL, LORA, jnp.float32)
    for a in mixed_rank_adapters():
        r = rank_class(a.rank, tuple(layouts))
        small = layouts[r].unpack(layouts[r].pack(a.weights, MODEL, LORA))
        wide = widen_slot_entries(jax.tree_util.tree_map(xp.asarray, small), r, LORA.max_rank, xp=xp)
        assert_trees_equal(jax.device_get(wide), expected_entries(a, MODEL, LORA, jnp.float32))


def test_widen_flat_gives_the_whole_slot_layout_buffer():
    layouts = FlatLayout.classes_for_bank(MODEL, LORA, jnp.bfloat16)
    full = layouts[LORA.max_rank]
    for a in mixed_rank_adapters():
        small = layouts[rank_class(a.rank, tuple(layouts))]
        got = jax.jit(lambda f, small=small: widen_flat(f, small=small, full=full))(
            jnp.asarray(small.pack(a.weights, MODEL, LORA))
        )
        np.testing.assert_array_equal(np.asarray(got), full.pack(a.weights, MODEL, LORA))
    with pytest.raises(ValueError, match="different banks"):
        other = FlatLayout.for_bank(MODEL, tiny_lora(max_rank=16), jnp.bfloat16, rank=8)
        widen_flat(jnp.zeros(other.size, jnp.bfloat16), small=other, full=full)


def test_class_layout_refuses_a_rank_above_its_class():
    layout = FlatLayout.for_bank(MODEL, LORA, jnp.float32, rank=8)
    nine = random_adapter("nine", MODEL, rank=9, modules=("q_proj",), rng=0)
    with pytest.raises(ValueError, match="rank class 8"):
        layout.pack(nine.weights, MODEL, LORA)
    with pytest.raises(ValueError, match="rank=17"):
        FlatLayout.for_bank(MODEL, LORA, jnp.float32, rank=17)


@pytest.mark.parametrize("host_memory", [HostMemory.PAGEABLE, HostMemory.PINNED])
def test_host_copies_and_page_ins_cost_the_class_bytes(host_memory):
    pager = Pager(MODEL, LORA, dtype=jnp.bfloat16, host_memory=host_memory)
    adapters = mixed_rank_adapters()
    class_bytes = {
        a.name: slot_nbytes(MODEL, LORA, jnp.bfloat16, rank=rank_class(a.rank, rank_classes(16))) for a in adapters
    }
    for a in adapters:
        pager.register(a.name, a)
        stored = pager.host_adapter(a.name)
        assert stored.nbytes == stored.flat.nbytes == class_bytes[a.name] == pager.info(a.name).nbytes
        assert stored.layout is pager.layouts[rank_class(a.rank, rank_classes(16))]  # shared per class
        assert_trees_equal(pager.host_entries(a.name), expected_entries(a, MODEL, LORA, jnp.bfloat16))
    assert pager.registered_bytes == sum(class_bytes.values()) < len(adapters) * pager.slot_nbytes
    for a in adapters:  # 3 usable slots: later adapters evict earlier ones of other classes
        assert pager.acquire(a.name) is None
        pager.commit()
        slot = pager.is_ready(a.name)
        assert_trees_equal(bank_slot(pager, slot), expected_entries(a, MODEL, LORA, jnp.bfloat16))
        pager.release(a.name)
    assert pager.metrics.bytes_moved == sum(class_bytes.values())
    pager.check()


def test_a_small_class_written_over_a_whole_slot_leaves_no_stale_columns():
    """One usable slot: rank 16 there first, then rank 1 evicts it (its columns 1..15 of every module
    must come out zero), then an unregister resets the slot from the smallest class's zeros."""
    pager = Pager(MODEL, tiny_lora(max_rank=16, max_slots=2, target_modules=ALL_MODULES), dtype=jnp.float32)
    adapters = mixed_rank_adapters()
    big, small = adapters[-1], adapters[0]
    for a in (big, small):
        pager.register(a.name, a)
    for a in (big, small):
        assert pager.acquire(a.name) is None
        pager.commit()
        assert pager.is_ready(a.name) == 1
        assert_trees_equal(bank_slot(pager, 1), expected_entries(a, MODEL, pager.lora_config, jnp.float32))
        pager.release(a.name)
    pager.unregister(small.name)
    pager.commit()
    assert not any(np.any(x) for x in jax.tree_util.tree_leaves(bank_slot(pager, 1)))


def test_folder_sources_reserve_a_whole_slot_then_pay_their_class(tmp_path):
    a = mixed_rank_adapters()[0]  # rank 1
    folder = save_peft_adapter(tmp_path / "one", weights=a.weights, rank=a.rank, alpha=float(a.rank))
    small = slot_nbytes(MODEL, LORA, jnp.float32, rank=4)
    pager = Pager(MODEL, LORA, host_capacity_bytes=slot_nbytes(MODEL, LORA, jnp.float32) + small - 1)
    pager.register("in-memory", a)  # its rank is known: reserves (and takes) a class-4 copy
    assert pager.registered_bytes == small
    with pytest.raises(CapacityError, match="host adapter memory is full"):
        pager.register("from-folder", folder)  # unread, it might be rank 16: a whole slot is reserved
    assert pager.registered_bytes == small and not pager.has("from-folder")
    roomy = Pager(MODEL, LORA)
    roomy.register("from-folder", folder)  # read, it is rank 1: charged its class's bytes, not a slot's
    assert roomy.registered_bytes == roomy.info("from-folder").nbytes == small


def test_mixed_class_page_ins_compile_nothing_after_construction():
    pager = Pager(MODEL, LORA, dtype=jnp.bfloat16)
    adapters = mixed_rank_adapters()
    for a in adapters:
        pager.register(a.name, a)
    before = backend_compiles()
    with jax.no_tracing():
        for a in adapters:
            assert pager.acquire(a.name) is None
            pager.commit()
            pager.release(a.name)
        pager.unregister(adapters[-1].name)
        pager.commit()
        jax.block_until_ready(pager.bank)
    assert backend_compiles() == before
