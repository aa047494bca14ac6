"""Prefix caching keyed by the weights: the page table's sharing and eviction, the scheduler's
cached prefixes, and, end to end, greedy tokens with the cache equal to those without it; nothing
is shared across adapters, or with an adapter's earlier weights under the same name."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from jaxlora.engine.kv_pages import PageTable
from jaxlora.engine.prefix_hash import BASE_IDENTITY, extend_keys
from jaxlora.engine.request import GenerationRequest, SamplingParams
from tests.engine.conftest import ADAPTERS, make_engine
from tests.engine.test_scheduler import FakeSlots, make_request, make_scheduler, run_step
from tests.factories import random_adapter

# The page table.


def _keys(tokens: list[int], page_size: int, root: bytes = BASE_IDENTITY) -> list[bytes]:
    keys: list[bytes] = []
    extend_keys(keys, root, tokens[: len(tokens) // page_size * page_size], page_size)
    return keys


def test_keys_chain_the_weights_and_every_earlier_token():
    a = _keys(list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    assert _keys([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == a[0]  # the first page alone decides the first key
    assert _keys([1, 0, 2, 3, *range(4, 12)], 4)[1:] != a[1:]  # an earlier token changes every later key
    assert not set(_keys(list(range(12)), 4, root=b"an adapter")) & set(a)  # other weights: other keys
    keys = a[:1]
    extend_keys(keys, BASE_IDENTITY, list(range(4, 12)), 4)  # extending hashes only the new pages
    assert keys == a
    with pytest.raises(ValueError, match="whole pages"):
        extend_keys([], BASE_IDENTITY, [1, 2, 3], 4)


def test_a_freed_prefix_is_shared_then_evicted_last_page_first():
    table = PageTable(6, 4, max_pages_per_seq=6)
    keys = _keys(list(range(12)), 4)
    table.grow(0, 12)
    table.register(0, keys, 0, 3)
    first = table.pages_of(0)
    table.free(0)
    assert (table.num_cached, table.num_free) == (3, 6)  # cached pages count as free
    assert table.lookup([keys[0], keys[1], b"other"]) == first[:2]
    assert table.can_admit(first[:2], 16) and not table.can_admit(first[:2], 24 + 1)
    table.attach(1, first[:2])
    table.attach(2, first[:1])  # two holders of one page
    assert (table.num_cached, table.num_free) == (1, 4)
    table.check()
    table.grow(1, 16)  # a never-keyed page first: the cached third page stays
    assert table.num_evictions == 0 and table.lookup(keys) == first
    table.grow(2, 12)  # the pool runs out of plain pages: the cached one is evicted
    assert table.num_evictions == 1 and table.lookup(keys) == first[:2]
    table.check()
    table.free(1)
    assert table.pages_of(2)[0] == first[0]  # still held by 2
    table.forget_cached()
    assert table.lookup(keys) == [] and table.num_cached == 0
    table.free(2)
    table.check()
    assert table.num_free == 6
    with pytest.raises(RuntimeError):
        table.attach(3, first[:1])  # no longer keyed


# The scheduler.


def _admit(s, req) -> int:
    """Adds `req`, runs it to its end; returns where its first chunk started."""
    s.add(req)
    starts = []
    for _ in range(20):
        plan, _ = run_step(s)
        s.adapters.slots.land()
        starts += [c.start for c in plan.prompt_chunks if c.request is req] if plan else []
        if req.is_finished:
            return starts[0]
    pytest.fail(f"{req} did not finish")


def test_a_prefix_that_ends_inside_a_page_is_recomputed_from_that_pages_start():
    s = make_scheduler(FakeSlots(2, {"a"}), prefix_caching=True, page_size=4, num_pages=16)
    first = make_request("first", prompt_len=10, max_tokens=1)  # prompt 0..9: pages [0,4) [4,8) cached
    assert _admit(s, first) == 0
    cases = {  # prompt -> where the first chunk starts
        (0, 1, 2, 3, 4, 5, 99): 4,  # ends inside the second page: recomputed from 4
        (0, 1, 2, 3, 4, 5, 6, 7): 4,  # two full pages, but its last token must be computed
        (0, 1, 2, 3, 4, 5, 6, 7, 8): 8,
        (9, 1, 2, 3, 4, 5, 6, 7, 8): 0,  # the first page differs: nothing after it matches
    }
    for prompt, start in cases.items():
        req = make_request(f"p{len(prompt)}", prompt_len=1, max_tokens=1)
        req.prompt_ids = list(prompt)
        assert _admit(s, req) == start, prompt
    under_adapter = make_request("adapter", adapter="a", prompt_len=10, max_tokens=1)
    assert _admit(s, under_adapter) == 0  # the same tokens on other weights share nothing
    assert s.num_prefix_hits == 4 + 4 + 8 and s.num_prefix_queries == 10 + 7 + 8 + 9 + 9 + 10
    s.pages.check()


def test_without_prefix_caching_nothing_is_keyed():
    s = make_scheduler(FakeSlots(1, set()), prefix_caching=False)
    _admit(s, make_request("one", prompt_len=10, max_tokens=3))
    assert _admit(s, make_request("two", prompt_len=10, max_tokens=3)) == 0
    assert s.pages.num_cached == 0 and s.num_prefix_queries == 0


# End to end: one engine with the cache and one without, over a pool small enough to preempt (20
# pages of 4 positions for four rows of up to 64). Same shapes: the second shares the compiled steps.

BASES = [np.random.default_rng(i).integers(4, 99, n).tolist() for i, n in enumerate((22, 13, 6))]


@pytest.fixture(scope="module")
def engines(parts):
    return {on: make_engine(parts, num_pages=20, enable_prefix_caching=on) for on in (True, False)}


def _request(rid: str, prompt: list[int], adapter: str | None, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, prompt_ids=prompt, adapter=adapter, sampling=SamplingParams(max_tokens=max_tokens)
    )


def _run(engine, requests: list[GenerationRequest], cancel: set[str] = frozenset()) -> dict[str, list[int]]:
    """Submits every request, cancels `cancel` after two steps, runs to the end; tokens by request."""
    with jax.no_tracing():
        handles = [engine.submit(r) for r in requests]
        engine.step()
        engine.step()
        for rid in cancel:
            engine.cancel(rid)
        engine.run_until_idle()
    engine.pages.check()
    return {r.request_id: list(h.result(0).token_ids) for r, h in zip(requests, handles) if r.request_id not in cancel}


REQUEST = st.tuples(
    st.integers(0, len(BASES) - 1),  # shared prefix
    st.lists(st.integers(4, 98), max_size=9),  # own suffix
    st.sampled_from([None, *ADAPTERS[:2]]),
    st.integers(1, 14),  # max_tokens
    st.booleans(),  # cancelled
)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(REQUEST, min_size=2, max_size=7))
def test_greedy_tokens_with_the_cache_equal_those_without(engines, mix):
    requests = [
        _request(f"m{i}", [1, *BASES[base], *suffix], adapter, max_tokens)
        for i, (base, suffix, adapter, max_tokens, _) in enumerate(mix)
    ]
    cancel = {r.request_id for r, m in zip(requests, mix) if m[-1]}
    want = _run(engines[False], requests, cancel)
    assert _run(engines[True], requests, cancel) == want
    assert engines[True].compiles_after_warmup == 0


def test_the_cache_hits_preempts_and_counts(engines):
    """Shared prefixes over the small pool: hits, evictions and preemptions all happen, and a
    second pass over the same prompts finds them cached."""
    requests = [_request(f"h{i}", [1, *BASES[0], *BASES[i % 3]], ADAPTERS[i % 2], 14) for i in range(8)]
    engine = engines[True]
    before = engine.stats()
    want = _run(engines[False], requests)
    assert _run(engine, requests) == want
    after = engine.stats()
    cache = after["prefix_cache"]
    assert cache["enabled"] and cache["hits"] > before["prefix_cache"]["hits"]
    assert 0 < cache["cached_share"] < 1 and cache["evictions"] > 0
    assert after["preemptions"] > before["preemptions"]
    assert engines[False].stats()["prefix_cache"] == {
        "enabled": False,
        "queries": 0,
        "hits": 0,
        "cached_share": 0.0,
        "cached_pages": 0,
        "evictions": 0,
    }


def _hits(engine) -> int:
    return engine.stats()["prefix_cache"]["hits"]


def test_the_same_prompt_under_two_adapters_shares_nothing(engines):
    engine = engines[True]
    prompt = [1, *BASES[1]]  # short: the three runs fit the pool without evicting each other's pages
    _run(engine, [_request("x0", prompt, ADAPTERS[2], 2)])
    hits = _hits(engine)
    for i, adapter in enumerate((ADAPTERS[3], None)):
        tokens = _run(engine, [_request(f"y{i}", prompt, adapter, 8)])
        assert _hits(engine) == hits
        assert tokens == _run(engines[False], [_request(f"y{i}", prompt, adapter, 8)])
    _run(engine, [_request("x1", prompt, ADAPTERS[2], 2)])
    assert _hits(engine) > hits  # the same adapter again: its pages were cached


def test_an_adapter_reloaded_with_other_weights_shares_nothing_with_its_earlier_pages(engines, parts):
    model, _, adapters = parts
    modules = adapters[ADAPTERS[0]].target_modules
    old, new = (random_adapter("reload", model.config, modules=modules, rng=seed) for seed in (50, 51))
    engine, plain = engines[True], engines[False]
    prompt = [1, *BASES[1], *BASES[0]]
    engine.register_adapter("reload", old)
    _run(engine, [_request("r0", prompt, "reload", 2)])
    engine.unregister_adapter("reload")
    engine.register_adapter("reload", new)
    plain.register_adapter("reload", new)
    hits = _hits(engine)
    assert _run(engine, [_request("r1", prompt, "reload", 8)]) == _run(plain, [_request("r1", prompt, "reload", 8)])
    assert _hits(engine) == hits
    # The old weights under another name are the same weights: they share the old pages.
    engine.register_adapter("same-as-old", old)
    _run(engine, [_request("r2", prompt, "same-as-old", 2)])
    assert _hits(engine) > hits
    for name in ("reload", "same-as-old"):
        engine.unregister_adapter(name)
    plain.unregister_adapter("reload")


def test_prefix_caching_switches_between_steps_with_an_empty_cache(engines):
    engine = engines[True]
    prompt = [1, *BASES[2], *BASES[0]]
    _run(engine, [_request("s0", prompt, None, 2)])
    engine.set_prefix_caching(False)
    hits = _hits(engine)
    _run(engine, [_request("s1", prompt, None, 2)])
    cache = engine.stats()["prefix_cache"]
    assert cache["hits"] == hits and cache["cached_pages"] == 0 and not cache["enabled"]
    engine.set_prefix_caching(True)
    _run(engine, [_request("s2", prompt, None, 2)])
    assert _hits(engine) == hits  # it starts empty
    _run(engine, [_request("s3", prompt, None, 2)])
    assert _hits(engine) > hits


def test_the_flag_switches_it_in_the_engine_config():
    import argparse

    from jaxlora.cli.engine_args import add_engine_args
    from jaxlora.cli.engine_args import engine_config as config_from_args
    from jaxlora.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args([])).enable_prefix_caching is EngineConfig().enable_prefix_caching is True
    assert config_from_args(p.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert config_from_args(p.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True
