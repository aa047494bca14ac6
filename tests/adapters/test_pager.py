"""The pager on CPU: registry, page-ins into the bank, pins, unregister, capacity, many adapters."""

from __future__ import annotations

import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.adapters import HostMemory, Pager
from jaxlora.errors import AdapterError, AdapterInUseError, CapacityError, UnknownAdapterError
from jaxlora.lora.bank import slot_arrays
from jaxlora.lora.host_adapter import HostAdapter
from jaxlora.lora.peft_format import save_peft_adapter
from tests.factories import random_adapter, random_adapters, tiny_config, tiny_lora

MODEL = tiny_config()


def bank_slot(pager: Pager, slot: int):
    return jax.tree_util.tree_map(lambda full: np.asarray(full[:, slot]), pager.bank)


def assert_slot_holds(pager: Pager, slot: int, entries) -> None:
    jax.tree_util.tree_map(np.testing.assert_array_equal, bank_slot(pager, slot), entries)


def assert_slot_zero(pager: Pager, slot: int) -> None:
    for x in jax.tree_util.tree_leaves(bank_slot(pager, slot)):
        assert not np.any(x), f"slot {slot} is not zero"


def make_pager(num_adapters: int = 0, **kwargs) -> tuple[Pager, list[HostAdapter]]:
    lora = kwargs.pop("lora", tiny_lora())
    pager = Pager(MODEL, lora, **kwargs)
    adapters = random_adapters(num_adapters, MODEL, lora)
    for a in adapters:
        pager.register(a.name, a)
    return pager, adapters


def acquire_ready(pager: Pager, name: str) -> int:
    slot = pager.acquire(name)
    if slot is None:
        pager.commit()
        slot = pager.is_ready(name)
    assert slot is not None
    return slot


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("host_memory", [HostMemory.PAGEABLE, HostMemory.PINNED])
def test_page_in_writes_the_padded_host_copy(dtype, host_memory):
    pager, adapters = make_pager(3, dtype=dtype, host_memory=host_memory)
    a = adapters[1]
    assert pager.acquire(a.name) is None  # cold: page-in queued
    assert pager.is_ready(a.name) is None and pager.slot_of(a.name) is not None
    pager.commit()
    slot = pager.is_ready(a.name)
    assert slot is not None and slot != 0
    expected = jax.tree_util.tree_map(
        lambda x: x.astype(np.dtype(dtype)), slot_arrays(a.weights, MODEL, pager.lora_config)
    )
    assert_slot_holds(pager, slot, expected)
    assert_slot_zero(pager, 0)
    assert pager.acquire(a.name) == slot  # warm: a hit
    m = pager.metrics
    assert (m.hits, m.misses, m.page_ins, m.bytes_moved) == (1, 1, 1, pager.slot_nbytes)
    info = pager.info(a.name)
    assert (info.resident, info.in_flight, info.rank) == (slot, 2, a.rank)


def test_lru_eviction_and_pins():
    lora = tiny_lora(max_slots=3)  # two usable slots
    pager, ads = make_pager(4, lora=lora)
    n0, n1, n2, n3 = (a.name for a in ads)
    s0, s1 = acquire_ready(pager, n0), acquire_ready(pager, n1)
    pager.release(n0)
    # n1 is pinned, so n2 must take n0's slot.
    assert acquire_ready(pager, n2) == s0
    assert pager.is_ready(n0) is None and pager.metrics.evictions == 1
    # Every slot pinned: n3 waits, it does not fail, and nothing pinned moves.
    assert pager.acquire(n3) is None
    pager.commit()
    assert pager.is_ready(n3) is None and pager.snapshot()["waiting"] == [n3]
    assert (pager.is_ready(n1), pager.is_ready(n2)) == (s1, s0)
    pager.release(n1)  # frees a slot for the waiting page-in
    pager.commit()
    assert pager.is_ready(n3) == s1
    assert_slot_holds(pager, s1, pager.host_entries(n3))
    pager.check()


def test_release_without_acquire_and_unknown_names():
    pager, ads = make_pager(1)
    with pytest.raises(ValueError, match="without a matching acquire"):
        pager.release(ads[0].name)
    with pytest.raises(UnknownAdapterError):
        pager.acquire("nope")
    with pytest.raises(UnknownAdapterError):
        pager.unregister("nope")


def test_warmup_keeps_every_written_slot():
    """warmup rewrites slot 1 with what it holds, so it is safe after adapters were paged in."""
    pager, ads = make_pager(3)
    slots = {a.name: acquire_ready(pager, a.name) for a in ads}
    assert sorted(slots.values()) == [1, 2, 3]
    with jax.no_tracing():  # compiled at construction
        pager.warmup()
    for a in ads:
        assert_slot_holds(pager, slots[a.name], pager.host_entries(a.name))
    assert_slot_zero(pager, 0)
    pager.release(ads[0].name)
    pager.unregister(ads[0].name)  # its slot's reset is queued, not yet written
    pager.warmup()
    pager.commit()
    assert_slot_zero(pager, slots[ads[0].name])
    pager.check()


def test_prefetch_fills_free_slots_without_pinning():
    pager, ads = make_pager(10)
    names = [a.name for a in ads]
    pager.prefetch(names)  # 7 usable slots: the first 7 names
    pager.commit()
    assert [pager.is_ready(n) is not None for n in names] == [True] * 7 + [False] * 3
    assert pager.metrics.prefetches == 7 and all(i.in_flight == 0 for i in pager.list())
    assert pager.acquire(names[0]) is not None  # a prefetched adapter is a hit
    # A request's acquire may evict prefetched (unpinned) adapters.
    assert pager.acquire(names[9]) is None
    pager.commit()
    assert pager.is_ready(names[9]) is not None
    pager.check()


def test_unregister_no_wait_refuses_then_wait_blocks_until_release():
    pager, ads = make_pager(2)
    name = ads[0].name
    slot = acquire_ready(pager, name)
    with pytest.raises(AdapterInUseError):
        pager.unregister(name, wait=False)
    with pytest.raises(AdapterInUseError, match="after 0.05 s"):
        pager.unregister(name, timeout=0.05)
    assert pager.has(name)

    done = threading.Event()
    waiter = threading.Thread(target=lambda: (pager.unregister(name), done.set()))
    waiter.start()
    time.sleep(0.05)
    assert not done.is_set()
    with pytest.raises(UnknownAdapterError, match="being unregistered"):
        pager.acquire(name)  # no new users while it drains
    assert pager.is_ready(name) == slot  # the running request keeps its slot
    pager.release(name)
    waiter.join(timeout=5)
    assert done.is_set() and not pager.has(name)
    pager.commit()  # the freed slot is zeroed
    assert_slot_zero(pager, slot)
    assert acquire_ready(pager, ads[1].name) == slot  # and reused
    pager.register(name, ads[0])  # the name is free again
    pager.check()


def test_bad_adapters_never_enter_the_registry(tmp_path):
    pager, ads = make_pager(2)
    good = ads[0].name
    slot = acquire_ready(pager, good)
    before = pager.registered_bytes

    corrupt = tmp_path / "corrupt"
    a = ads[1]
    save_peft_adapter(corrupt, weights=dict(a.weights), rank=a.rank, alpha=a.rank)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    nan_weights = {m: (a_.copy(), b_.copy()) for m, (a_, b_) in a.weights.items()}
    next(iter(nan_weights.values()))[1][0, 0, 0] = np.nan
    huge_weights = {m: (a_.copy(), b_.copy()) for m, (a_, b_) in a.weights.items()}
    next(iter(huge_weights.values()))[1][0, 0, 0] = 1e30  # finite, but would decode NaN
    bad_sources = {
        "corrupt": corrupt,
        "missing": tmp_path / "does-not-exist",
        "nan": HostAdapter(name="nan", rank=a.rank, target_modules=a.target_modules, weights=nan_weights),
        "huge": HostAdapter(name="huge", rank=a.rank, target_modules=a.target_modules, weights=huge_weights),
        "too-big": random_adapter("too-big", MODEL, rank=8, modules=("q_proj",), rng=np.random.default_rng(0)),
        "gate": random_adapter("gate", MODEL, rank=2, modules=("gate_proj",), rng=np.random.default_rng(0)),
        "wrong-shape": random_adapter(
            "x",
            tiny_config(hidden_size=16, num_heads=2, num_kv_heads=1),
            rank=2,
            modules=("q_proj",),
            rng=np.random.default_rng(0),
        ),
        "bad/name": a,
        good: a,  # name taken
        "not-a-source": 42,
    }
    for name, source in bad_sources.items():
        with pytest.raises(AdapterError):
            pager.register(name, source)
    assert sorted(i.name for i in pager.list()) == sorted(x.name for x in ads)
    assert pager.registered_bytes == before
    assert pager.is_ready(good) == slot
    assert_slot_holds(pager, slot, pager.host_entries(good))


def test_register_from_a_peft_folder(tmp_path):
    pager, _ = make_pager(0)
    a = random_adapters(1, MODEL, pager.lora_config, seed=5)[0]
    folder = save_peft_adapter(tmp_path / "a", weights=dict(a.weights), rank=a.rank, alpha=2 * a.rank)
    info = pager.register("from-disk", folder)
    assert info.source == str(folder) and info.rank == a.rank and info.target_modules == a.target_modules
    slot = acquire_ready(pager, "from-disk")
    b = bank_slot(pager, slot)
    assert np.abs(next(iter(jax.tree_util.tree_leaves(b)))).sum() > 0


def test_host_capacity_is_enforced_in_bytes():
    lora = tiny_lora()
    probe = Pager(MODEL, lora)
    pager, ads = make_pager(0, lora=lora, host_capacity_bytes=3 * probe.slot_nbytes + 1)
    more = random_adapters(4, MODEL, lora)
    for a in more[:3]:
        pager.register(a.name, a)
    with pytest.raises(CapacityError, match="host adapter memory is full"):
        pager.register(more[3].name, more[3])
    pager.unregister(more[0].name)
    pager.register(more[3].name, more[3])
    assert pager.registered_bytes == 3 * pager.slot_nbytes


def test_concurrent_registration_respects_capacity():
    lora = tiny_lora()
    probe = Pager(MODEL, lora)
    pager = Pager(MODEL, lora, host_capacity_bytes=10 * probe.slot_nbytes)
    ads = random_adapters(40, MODEL, lora)
    results: list[str] = []

    def register(a):
        try:
            pager.register(a.name, a)
            results.append("ok")
        except CapacityError:
            results.append("full")

    threads = [threading.Thread(target=register, args=(a,)) for a in ads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("ok") == 10 and len(pager.list()) == 10


def test_thousand_adapters_eight_slots_power_law_no_compiles():
    """1,000 registered, 8 slots, 300 requests over 200 adapters (power law), a simulated engine loop."""
    pager, ads = make_pager(1000)
    rng = np.random.default_rng(0)
    popular = [ads[i].name for i in rng.permutation(1000)[:200]]
    requests = [popular[int(i)] for i in rng.power(0.3, 300) * 200]  # S-LoRA's power-law sampling
    max_rows, steps_per_request = 6, 3
    queue, running, finished = list(requests), {}, 0  # running: request id -> [adapter, steps left]
    ids = itertools.count()
    compiles = []

    def on_event(event, *_, **__):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        with jax.no_tracing():
            while finished < len(requests):
                while queue and len(running) < max_rows and pager.can_place(queue[0]):
                    name = queue.pop(0)
                    pager.acquire(name)
                    running[next(ids)] = [name, steps_per_request]
                pager.prefetch(queue[:4])
                pager.commit()
                for key, (name, _left) in list(running.items()):
                    slot = pager.is_ready(name)
                    if slot is None:
                        continue
                    assert_slot_holds(pager, slot, pager.host_entries(name))
                    running[key][1] -= 1
                    if running[key][1] == 0:
                        pager.release(name)
                        del running[key]
                        finished += 1
                pager.check()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    m = pager.metrics
    assert not compiles
    assert m.hits + m.misses == 300 and m.page_ins >= len(set(requests)) and m.evictions > 0
    assert all(i.in_flight == 0 for i in pager.list())


def test_commit_while_a_step_reading_the_bank_is_in_flight():
    """The engine dispatches step N, then commits: the step sees the bank as it was at dispatch."""
    pager, ads = make_pager(3, lora=tiny_lora(max_slots=3))
    hot = ads[0].name
    slot = acquire_ready(pager, hot)
    pager.prefetch([ads[1].name])
    pager.commit()
    read_slots = jax.jit(lambda bank, s: jax.tree_util.tree_map(lambda full: full[:, s] * 1, bank))
    expected_hot, expected_other = pager.host_entries(hot), pager.host_entries(ads[1].name)
    other = pager.is_ready(ads[1].name)
    read_slots(pager.bank, jnp.asarray(0, jnp.int32))  # compile
    step_hot = read_slots(pager.bank, jnp.asarray(slot, jnp.int32))
    step_other = read_slots(pager.bank, jnp.asarray(other, jnp.int32))
    assert pager.acquire(ads[2].name) is None  # evicts the unpinned prefetched adapter
    pager.commit()  # donates the bank the dispatched reads use
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(step_hot), expected_hot)
    jax.tree_util.tree_map(np.testing.assert_array_equal, jax.device_get(step_other), expected_other)
    assert pager.is_ready(ads[2].name) == other
    assert_slot_holds(pager, other, pager.host_entries(ads[2].name))


def test_staged_copies_commit_correctly_after_the_slot_table_changes():
    """stage() starts copies; evictions, re-assignments and unregisters before the commit leave
    every slot holding what the slot table says (or zero), and stale writes never mark ready."""
    pager, ads = make_pager(5, lora=tiny_lora(max_slots=3))  # two usable slots
    a, b, c, d, e = (x.name for x in ads)
    pager.prefetch([a, b])
    pager.stage()  # copies of a and b in flight, nothing written
    assert pager.is_ready(a) is None and pager.is_ready(b) is None
    assert pager.acquire(c) is None  # evicts the unpinned prefetched a (LRU) before a was written
    pager.unregister(b)  # b's slot is freed and queued for zeroing
    pager.commit()
    assert pager.is_ready(a) is None and not pager.has(b)
    slot_c = pager.is_ready(c)
    assert slot_c is not None
    assert_slot_holds(pager, slot_c, pager.host_entries(c))
    (other,) = {1, 2} - {slot_c}
    assert_slot_zero(pager, other)
    # A staged page-in whose adapter comes back to the same slot before the commit.
    assert pager.acquire(d) is None  # takes the free slot
    pager.stage()
    pager.release(d)
    assert pager.acquire(e) is None  # evicts the unpinned, staged d
    pager.release(e)
    assert pager.acquire(d) is None  # evicts e, d is queued again (maybe on the same slot)
    pager.commit()
    slot_d = pager.is_ready(d)
    assert slot_d is not None and pager.is_ready(e) is None
    assert_slot_holds(pager, slot_d, pager.host_entries(d))
    pager.check()


def test_slot_at_commit_is_the_slot_once_staged():
    """A staged adapter is usable by calls dispatched after the next commit, not before."""
    pager, ads = make_pager(3, lora=tiny_lora(max_slots=2))  # one usable slot
    a, b = ads[0].name, ads[1].name
    assert pager.acquire(a) is None
    assert pager.slot_at_commit(a) is None  # queued, copy not started
    pager.stage()
    assert pager.slot_at_commit(a) == pager.slot_of(a) == 1 and pager.is_ready(a) is None
    pager.commit()
    assert pager.is_ready(a) == pager.slot_at_commit(a) == 1
    pager.release(a)
    pager.prefetch([b])
    pager.stage()
    assert pager.slot_at_commit(b) == 1 and pager.slot_at_commit(a) is None  # a was evicted
    assert pager.acquire(a) is None  # evicts the unpinned, staged b: a is queued again on slot 1
    assert pager.slot_at_commit(a) is None and pager.slot_at_commit(b) is None
    pager.commit()
    assert pager.is_ready(a) == 1 and pager.is_ready(b) is None
    assert_slot_holds(pager, 1, pager.host_entries(a))


def test_commit_writes_at_most_the_cap_and_never_compiles_again():
    lora = tiny_lora(max_slots=9)
    pager, ads = make_pager(8, lora=lora, max_page_ins_per_commit=3)
    assert pager._write_sizes == (1, 2, 3)
    with jax.no_tracing():  # every k in 1..3 was compiled at construction
        for a in ads:
            assert pager.acquire(a.name) is None
        pager.commit()
        assert sum(pager.is_ready(a.name) is not None for a in ads) == 3
        pager.commit()
        pager.commit()
        assert all(pager.is_ready(a.name) is not None for a in ads)
    for a in ads:
        assert_slot_holds(pager, pager.is_ready(a.name), pager.host_entries(a.name))
    with pytest.raises(ValueError, match="max_page_ins_per_commit"):
        Pager(MODEL, lora, max_page_ins_per_commit=0)


def test_register_and_unregister_from_other_threads_while_serving():
    pager, ads = make_pager(12)
    churn = random_adapters(20, MODEL, pager.lora_config, seed=9, prefix="churn")
    stop = threading.Event()
    errors: list[BaseException] = []

    def admin():
        try:
            while not stop.is_set():
                for a in churn:
                    pager.register(a.name, a)
                    time.sleep(0.001)  # leave the GIL to the serving loop
                for a in churn:
                    pager.unregister(a.name, timeout=5)
                    time.sleep(0.001)
        except BaseException as e:  # surfaced below
            errors.append(e)

    thread = threading.Thread(target=admin)
    thread.start()
    rng = np.random.default_rng(0)
    try:
        for _ in range(80):
            names = [ads[i].name for i in rng.integers(0, 12, 3)]
            for n in names:
                pager.acquire(n)
            for n in [c.name for c in churn[:2]]:
                try:
                    pager.acquire(n)
                    names.append(n)
                except UnknownAdapterError:
                    pass
            pager.commit()
            for n in names:
                slot = pager.is_ready(n)
                assert slot is not None
                assert_slot_holds(pager, slot, pager.host_entries(n))
                pager.release(n)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not errors
    pager.check()


def test_page_ins_of_pinned_adapters_go_before_prefetches():
    """With more queued than one commit writes, a request's page-in is not held back by prefetches."""
    lora = tiny_lora(max_slots=6)
    pager, ads = make_pager(5, lora=lora, max_page_ins_per_commit=2)
    pager.prefetch([a.name for a in ads[:4]])  # four prefetches queued first
    assert pager.acquire(ads[4].name) is None  # then a request's adapter
    pager.commit()
    assert pager.is_ready(ads[4].name) is not None  # written by the first commit
    assert sum(pager.is_ready(a.name) is not None for a in ads[:4]) == 1
    pager.commit()
    pager.commit()
    assert all(pager.is_ready(a.name) is not None for a in ads)
    pager.check()


def test_latency_histograms_count_every_page_in_and_every_load():
    from jaxlora.adapters.metrics import LatencyHistogram

    h = LatencyHistogram((0.01, 0.1))
    for seconds in (0.005, 0.01, 0.05, 3.0):  # an upper bound is inclusive (Prometheus `le`)
        h.observe(seconds)
    assert h.counts() == [2, 1, 1] and h.count == 4 and h.sum == pytest.approx(3.065)
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyHistogram((0.1, 0.01))

    pager, ads = make_pager(3, lora=tiny_lora(max_slots=3))
    m = pager.metrics
    assert m.host_load.count == 3 and m.device_page_in.count == 0
    for a in ads:  # two slots: the third page-in evicts the first adapter
        acquire_ready(pager, a.name)
        pager.release(a.name)
    assert m.device_page_in.count == m.page_ins == 3 == len(m.page_in_seconds)
    assert m.device_page_in.sum == pytest.approx(sum(m.page_in_seconds))
