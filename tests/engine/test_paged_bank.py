"""The engine over a paged adapter bank (lora.bank: paged): the same tokens as the padded bank for
mixed-rank batches, device bytes that follow each adapter's rank, eviction when pages run out, free
pages that are never read, and no compile after warm-up while adapters page in and out."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxlora.adapters import PagedPager, Pager
from jaxlora.config import TARGET_MODULES, LoraBank, LoraConfig
from jaxlora.engine import Engine, GenerationRequest, SamplingParams
from jaxlora.lora.host_adapter import HostAdapter
from tests.engine.conftest import engine_config
from tests.factories import char_tokenizer, random_adapter, tiny_model

MAX_TOKENS = 6
PADDED = LoraConfig(max_slots=7, max_rank=64, target_modules=TARGET_MODULES)
PAGED = dataclasses.replace(PADDED, bank=LoraBank.PAGED, page_rows=8)


def pattern_adapter(name: str, config, rng: int) -> HostAdapter:
    """A `rank_pattern`-like adapter: a different rank per module, some modules untouched."""
    ranks = {"q_proj": 2, "v_proj": 16, "gate_proj": 9, "down_proj": 64}
    gen = np.random.default_rng(rng)
    weights = {}
    for m, r in ranks.items():
        d_in, d_out = config.module_shape(m)
        a = gen.normal(0, 2 / np.sqrt(d_in), (config.num_layers, d_in, r)).astype(np.float32)
        b = gen.normal(0, 2, (config.num_layers, r, d_out)).astype(np.float32)
        weights[m] = (a, b)
    return HostAdapter(name=name, rank=64, target_modules=tuple(ranks), weights=weights, source=f"random:{name}")


@pytest.fixture(scope="module")
def parts():
    model, tok = tiny_model(), char_tokenizer()
    adapters = {
        f"r{r}": random_adapter(f"r{r}", model.config, modules=TARGET_MODULES, rank=r, rng=r) for r in (4, 8, 16, 64)
    }
    adapters["attn8"] = random_adapter("attn8", model.config, modules=("q_proj", "o_proj"), rank=8, rng=11)
    adapters["pattern"] = pattern_adapter("pattern", model.config, rng=12)
    return model, tok, adapters


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


def requests(names: list[str | None], seed: int = 0) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            request_id=f"q{i}",
            prompt_ids=[int(t) for t in rng.integers(4, 60, 3 + i % 4)],
            adapter=name,
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
        )
        for i, name in enumerate(names)
    ]


MIXED = ["r4", None, "r8", "pattern", "r16", "r64", None, "attn8"]


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
    # rank_pattern: pages per module follow each module's rank (2, 16, 9, 64 -> 1, 2, 2, 8 pages).
    assert pager.device_nbytes("pattern") == 2 * model.config.num_layers * (1 + 2 + 2 + 8) * pager.page_nbytes
    assert pager.pool_usage()["adapter_pages"] * pager.page_nbytes == r8 + r64 + pager.device_nbytes("pattern")


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


@pytest.mark.parametrize("lora", [PADDED, PAGED], ids=["padded", "paged"])
def test_a_waiting_request_whose_adapter_is_unregistered_fails_alone(parts, lora):
    """B waits for a row while its adapter is unregistered: once a row frees, B fails with an
    unknown-adapter error, and the engine goes on serving (A before it, C after it)."""
    model, tok, adapters = parts
    config = engine_config(max_batch=1, token_budgets=(8, 16), lora=lora)
    pager = (
        PagedPager(model.config, lora, dtype=model.dtype)
        if lora.bank is LoraBank.PAGED
        else Pager(model.config, lora, dtype=model.dtype)
    )
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
