"""The engine over a paged adapter bank (lora.bank: paged): the same tokens as the padded bank for
mixed-rank batches, device bytes that follow each adapter's rank, eviction when pages run out, free
pages that are never read, and no compile after warm-up while adapters page in and out."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from jaxlora.adapters import PagedPager, Pager, UnifiedPager
from jaxlora.config import TARGET_MODULES, LoraBank, LoraConfig
from jaxlora.engine import Engine, GenerationRequest, SamplingParams
from tests.engine.bank_data import MIXED, bank_parts, requests
from tests.engine.conftest import engine_config
from tests.factories import char_tokenizer, random_adapter, tiny_model

PADDED = LoraConfig(max_slots=7, max_rank=64, target_modules=TARGET_MODULES)
PAGED = dataclasses.replace(PADDED, bank=LoraBank.PAGED, page_rows=8)


@pytest.fixture(scope="module")
def parts():
    return bank_parts()


def make_engine(parts, lora: LoraConfig, *, fill: float = float("nan"), **overrides) -> Engine:
    model, tok, adapters = parts
    config = engine_config(max_batch=8, token_budgets=(8, 16, 32), lora=lora, **overrides)
    if lora.bank is LoraBank.PAGED:
        pager = PagedPager(model.config, lora, dtype=model.dtype, fill=fill)
    else:
        pager = Pager(model.config, lora, dtype=model.dtype)
    for name, adapter in adapters.items():
        pager.register(name, adapter)
    engine = Engine(model, tok, config, pager)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def padded_tokens(parts):
    engine = make_engine(parts, PADDED)
    return [out.token_ids for out in engine.generate(requests(MIXED))]


def test_mixed_ranks_same_tokens_as_the_padded_bank_with_nan_free_pages(parts, padded_tokens):
    """Ranks 4-64, a per-module rank pattern, attention-only and base rows in one batch; the pool
    starts as NaN, so a read of a free page or of a row past a rank would poison the tokens."""
    engine = make_engine(parts, PAGED, fill=float("nan"))
    with jax.no_tracing():
        got = [out.token_ids for out in engine.generate(requests(MIXED))]
    assert got == padded_tokens
    base = make_engine(parts, PAGED)  # zero-filled pool: the adapters do change the tokens
    assert [out.token_ids for out in base.generate(requests([None] * len(MIXED)))] != padded_tokens
    assert engine.compiles_after_warmup == 0
    engine.pager.check()


def test_device_bytes_follow_the_rank(parts):
    model, _, adapters = parts
    pager = PagedPager(model.config, PAGED, dtype=model.dtype)
    for name in ("r8", "r64", "pattern"):
        pager.register(name, adapters[name])
        pager.acquire(name)
    pager.commit()
    r8, r64 = pager.device_nbytes("r8"), pager.device_nbytes("r64")
    assert 0 < r8 <= (1 / 8 + 0.05) * r64
    # rank_pattern: pages per module follow each module's rank (2, 16, 9, 64 -> 1, 2, 2, 8 pages),
    # each factor's pages at its own width.
    pages = {"q_proj": 1, "v_proj": 2, "gate_proj": 2, "down_proj": 8}
    assert pager.device_nbytes("pattern") == sum(
        model.config.num_layers * n * PAGED.page_rows * sum(model.config.module_shape(m)) * 4 for m, n in pages.items()
    )
    assert pager.pool_usage()["adapter_bytes"] == r8 + r64 + pager.device_nbytes("pattern")


def true_rank_bytes(config, ranks: dict[str, int], page_rows: int, itemsize: int) -> int:
    """Bytes of each module's rank-rows at their own widths (A^T rows in_m wide, B rows out_m wide),
    the rank rounded up to whole pages of rows and nothing else."""
    return sum(
        config.num_layers * -(-r // page_rows) * page_rows * sum(config.module_shape(m)) * itemsize
        for m, r in ranks.items()
    )


def test_an_all_module_adapters_device_bytes_are_its_rows_at_their_own_widths(parts):
    """No pool column is padding: an all-module adapter (q/k/v/o/gate/up/down, GQA k/v narrower than
    q, the MLP wider than hidden) holds exactly its true-rank rows at each module's widths, on the
    device and in its host copy; one pool per distinct width."""
    model, _, adapters = parts
    config = model.config
    pager = PagedPager(config, PAGED, dtype=model.dtype)
    widths = {config.hidden_size, config.intermediate_size, config.kv_size, config.q_size}
    assert sorted(pager.state["pools"]) == sorted(widths) and len(widths) == 3
    for name in ("r4", "r8", "r16", "r64"):
        pager.register(name, adapters[name])
        pager.acquire(name)
    pager.commit()
    for name in ("r4", "r8", "r16", "r64"):
        ranks = pager.host_adapter(name).module_ranks
        assert set(ranks) == set(TARGET_MODULES) and len(set(ranks.values())) == 1
        exact = true_rank_bytes(config, ranks, PAGED.page_rows, 4)
        assert pager.device_nbytes(name) == exact == pager.host_adapter(name).flat.nbytes
        if ranks["q_proj"] % PAGED.page_rows == 0:  # whole pages: the factors' own bytes, exactly
            assert exact == sum(a.nbytes + b.nbytes for a, b in adapters[name].weights.values())
    usage = pager.pool_usage()
    assert usage["adapter_bytes"] == sum(pager.device_nbytes(n) for n in ("r4", "r8", "r16", "r64"))
    assert sum(p["adapter_pages"] for p in usage["pools"].values()) == usage["adapter_pages"]
    pager.check()


def test_a_7b_all_module_adapter_has_no_width_padding():
    """Llama-2-7B shapes (hidden 4096, MLP 11008), rank 16 on all seven modules, bf16: two pools,
    and the adapter's pages are its rank-rows at their widths (one pool of width 11008 would pad
    every 4096-wide row)."""
    from benchmarks.common import LLAMA2_7B
    from jaxlora.lora.paged_bank import adapter_pages, pages_nbytes, pool_widths

    lora = dataclasses.replace(PAGED, max_rank=16, max_slots=2)
    assert pool_widths(LLAMA2_7B, lora) == (4096, 11008)
    ranks = dict.fromkeys(TARGET_MODULES, 16)
    got = pages_nbytes(adapter_pages(ranks, LLAMA2_7B, lora), lora.page_rows, 2)
    assert got == true_rank_bytes(LLAMA2_7B, ranks, lora.page_rows, 2)
    one_pool = LLAMA2_7B.num_layers * len(TARGET_MODULES) * 2 * 16 * 11008 * 2
    assert got < 0.56 * one_pool


def test_page_pressure_evicts_the_lru_unpinned_adapter_and_frees_its_pages(parts):
    """A pool of exactly two rank-64 adapters' pages: a third waits while both are pinned, and takes
    the least recently used one's pages once it is released."""
    model, _, adapters = parts
    full = 2 * model.config.num_layers * len(TARGET_MODULES) * 8
    lora = dataclasses.replace(PAGED, pool_pages=2 * full)
    pager = PagedPager(model.config, lora, dtype=model.dtype)
    big = {n: random_adapter(n, model.config, modules=TARGET_MODULES, rank=64, rng=i) for i, n in enumerate("abc")}
    for name, adapter in big.items():
        pager.register(name, adapter)
    assert pager.acquire("a") is None and pager.acquire("b") is None
    pager.commit()
    assert pager.is_ready("a") and pager.is_ready("b")
    assert not pager.can_place("c")
    assert pager.acquire("c") is None  # waits: every page is pinned
    pager.commit()
    assert pager.slot_of("c") is None and pager.snapshot()["waiting"] == ["c"]
    pager.check()
    pager.release("a")  # "a" is now the LRU unpinned adapter
    pager.commit()
    assert pager.is_ready("c") and pager.slot_of("a") is None and pager.is_ready("b")
    assert pager.pool_usage()["free_pages"] == 0 and pager.metrics.evictions == 1
    pager.check()
    # Small adapters fit beside a big one: the pool, not the slot count, is the limit.
    pager.release("b")
    pager.release("c")
    for name in ("r4", "r8", "r16"):
        pager.register(name, adapters[name])
        pager.acquire(name)
    pager.commit()
    assert all(pager.is_ready(n) for n in ("r4", "r8", "r16"))
    pager.check()


def test_eviction_under_page_pressure_in_one_pool_while_another_has_room(parts):
    """q_proj (A^T and B 32 wide) and gate_proj (A^T 32 wide, B 64 wide): the 64-wide pool holds one
    gate adapter. A second gate adapter evicts the first (the only holder of 64-wide pages), not the
    less recently used q-only adapter whose pages lie in the 32-wide pool, which has room."""
    model, _, _ = parts
    config = model.config
    lora = dataclasses.replace(PAGED, target_modules=("q_proj", "gate_proj"))
    unit = config.num_layers * 8  # pages of one factor at rank 64
    lora = dataclasses.replace(lora, pool_pages=4 * unit)  # one full adapter: 3 units at 32, 1 at 64
    pager = PagedPager(config, lora, dtype=model.dtype)
    assert pager.pool_usage()["pools"] == {
        32: {"pages": 3 * unit, "adapter_pages": 0, "free_pages": 3 * unit},
        64: {"pages": unit, "adapter_pages": 0, "free_pages": unit},
    }
    made = {
        "q8": random_adapter("q8", config, modules=("q_proj",), rank=8, rng=1),
        "g1": random_adapter("g1", config, modules=("gate_proj",), rank=64, rng=2),
        "g2": random_adapter("g2", config, modules=("gate_proj",), rank=64, rng=3),
    }
    for name, adapter in made.items():
        pager.register(name, adapter)
    for name in ("q8", "g1"):
        pager.acquire(name)
        pager.commit()
        pager.release(name)
    assert pager.is_ready("q8") and pager.is_ready("g1")
    pager.acquire("g2")
    assert not pager.can_place("g1")  # its 64-wide pages are held by pinned g2
    pager.commit()
    assert pager.is_ready("g2") and pager.slot_of("g1") is None and pager.is_ready("q8")
    assert pager.metrics.evictions == 1
    pools = pager.pool_usage()["pools"]
    assert pools[64]["free_pages"] == 0 and pools[32]["free_pages"] == 3 * unit - 2 * config.num_layers - unit
    pager.check()
    # g2 pinned: g1 waits for 64-wide pages though the 32-wide pool has room, and takes nothing.
    assert pager.acquire("g1") is None
    pager.commit()
    assert pager.snapshot()["waiting"] == ["g1"] and pager.pool_usage()["pools"] == pools
    pager.check()
    pager.release("g2")
    pager.commit()
    assert pager.is_ready("g1") and pager.slot_of("g2") is None and pager.is_ready("q8")
    pager.check()


def test_pool_pages_is_split_over_the_pools_in_proportion_to_the_default(parts):
    from jaxlora.lora.paged_bank import default_pool_pages, full_adapter_pages, num_pool_pages

    config = parts[0].config
    full = full_adapter_pages(config, PAGED)
    assert num_pool_pages(config, PAGED) == default_pool_pages(config, PAGED)
    assert default_pool_pages(config, PAGED) == {w: (PAGED.max_slots - 1) * n for w, n in full.items()}
    total = sum(full.values())
    assert num_pool_pages(config, dataclasses.replace(PAGED, pool_pages=3 * total)) == {
        w: 3 * n for w, n in full.items()
    }
    odd = num_pool_pages(config, dataclasses.replace(PAGED, pool_pages=total + 5))
    assert sum(odd.values()) == total + 5 and all(odd[w] >= n for w, n in full.items())
    with pytest.raises(ValueError, match="at least one adapter at max_rank"):
        num_pool_pages(config, dataclasses.replace(PAGED, pool_pages=total - 1))


GQA_PADDED = LoraConfig(max_slots=5, max_rank=16, target_modules=TARGET_MODULES)
GQA_PAGED = dataclasses.replace(GQA_PADDED, bank=LoraBank.PAGED, page_rows=4)


def test_in_and_out_widths_differ_gqa_model_same_tokens_as_the_padded_bank():
    """A model whose factor widths all differ (hidden 32, MLP 48, GQA k/v 8 wide: three pools),
    mixed ranks and an adapter on k/v/down only beside base rows, free pages NaN: the paged bank's
    greedy tokens are the padded bank's."""
    model = tiny_model(intermediate_size=48, num_kv_heads=1)
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.kv_size) == (32, 48, 8)
    adapters = {f"r{r}": random_adapter(f"r{r}", config, modules=TARGET_MODULES, rank=r, rng=r) for r in (3, 16)}
    adapters["kv"] = random_adapter("kv", config, modules=("k_proj", "v_proj", "down_proj"), rank=5, rng=7)
    parts = (model, char_tokenizer(), adapters)
    names = ["r3", None, "kv", "r16", None, "r3"]
    padded = [out.token_ids for out in make_engine(parts, GQA_PADDED).generate(requests(names, seed=1))]
    engine = make_engine(parts, GQA_PAGED, fill=float("nan"))
    assert sorted(engine.pager.state["pools"]) == [8, 32, 48]
    with jax.no_tracing():
        got = [out.token_ids for out in engine.generate(requests(names, seed=1))]
    assert got == padded
    base = [out.token_ids for out in make_engine(parts, GQA_PAGED).generate(requests([None] * len(names), seed=1))]
    assert base != padded
    assert engine.compiles_after_warmup == 0
    engine.pager.check()


def test_no_compiles_after_warmup_as_adapters_page_in_and_out(parts, padded_tokens):
    """A pool for about two adapters: the mixed batch's adapters page in and out between requests,
    and the tokens stay the padded bank's."""
    model, _, _ = parts
    full = 2 * model.config.num_layers * len(TARGET_MODULES) * 8
    lora = dataclasses.replace(PAGED, pool_pages=full + full // 2)
    engine = make_engine(parts, lora, max_adapters_per_batch=2)
    with jax.no_tracing():
        got = [out.token_ids for out in engine.generate(requests(MIXED))]
    assert got == padded_tokens
    assert engine.pager.metrics.evictions > 0
    assert engine.compiles_after_warmup == 0
    engine.pager.check()


@pytest.mark.parametrize(
    "lora", [PADDED, PAGED, dataclasses.replace(PADDED, bank=LoraBank.UNIFIED)], ids=["padded", "paged", "unified"]
)
def test_a_waiting_request_whose_adapter_is_unregistered_fails_alone(parts, lora):
    """B waits for a row while its adapter is unregistered: once a row frees, B fails with an
    unknown-adapter error, and the engine goes on serving (A before it, C after it)."""
    model, tok, adapters = parts
    config = engine_config(max_batch=1, token_budgets=(8, 16), lora=lora)
    pagers = {
        LoraBank.PADDED: lambda: Pager(model.config, lora, dtype=model.dtype),
        LoraBank.PAGED: lambda: PagedPager(model.config, lora, dtype=model.dtype),
        LoraBank.UNIFIED: lambda: UnifiedPager(model.config, lora, page_size=config.page_size, dtype=model.dtype),
    }
    pager = pagers[lora.bank]()
    pager.register("r4", adapters["r4"])
    engine = Engine(model, tok, config, pager)
    a, b, c = (
        GenerationRequest(request_id=rid, prompt_ids=[5, 6, 7], adapter=name, sampling=SamplingParams(max_tokens=4))
        for rid, name in (("A", None), ("B", "r4"), ("C", None))
    )
    fa = engine.submit(a)
    engine.step()
    fb = engine.submit(b)
    engine.step()
    engine.unregister_adapter("r4", wait=False)
    fc = engine.submit(c)
    for _ in range(20):
        engine.step()
        if fc.done:
            break
    assert len(fa.result(0).token_ids) == 4 and len(fc.result(0).token_ids) == 4
    failed = fb.result(0)
    assert failed.finish_reason == "error" and "r4" in failed.error and not failed.token_ids
