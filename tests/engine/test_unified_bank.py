"""The engine over a unified bank (lora.bank: unified, S-LoRA's unified pool): adapters at their true
rank in the KV cache's own pages, one allocator. The same tokens as the padded bank for mixed-rank
batches with every free page NaN; device bytes that follow each adapter's rank; idle adapters' pages
going back to sequences (no preemption while an idle adapter holds pages); an adapter page-in that
waits for pages rather than take a sequence's; no compile after warm-up while adapters page in and
out; a lost pool; unregistering from another thread."""

from __future__ import annotations

import dataclasses
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlora.adapters import Pager, UnifiedPager
from jaxlora.config import TARGET_MODULES, LoraBank, LoraConfig
from jaxlora.engine import Engine
from jaxlora.engine.build import build_engine
from jaxlora.errors import AdapterError
from jaxlora.lora import apply
from jaxlora.lora.paged_bank import page_counts, page_runs
from jaxlora.lora.unified_layout import FACTOR_ALIGN, adapter_layout, pack_run
from jaxlora.model.params import build_model
from tests.engine.bank_data import MIXED, bank_parts, requests
from tests.engine.conftest import engine_config

PADDED = LoraConfig(max_slots=7, max_rank=64, target_modules=TARGET_MODULES)
UNIFIED = dataclasses.replace(PADDED, bank=LoraBank.UNIFIED)  # the XLA gather (lora.backend xla)
UNIFIED_PALLAS = dataclasses.replace(UNIFIED, backend="pallas")  # the Pallas kernels, interpreted
PAGE_SIZE = 4  # engine_config's


@pytest.fixture(scope="module")
def parts():
    return bank_parts()


def make_engine(
    parts,
    lora: LoraConfig,
    *,
    nan_pool: bool = True,
    warm: bool = True,
    fused: bool = False,
    host_memory: str = "auto",
    **overrides,
) -> Engine:
    """An engine over `parts`' adapters; a unified one's KV pool starts NaN (a read of a free page,
    or of a page past an adapter's, would poison the tokens). fused: the model in the serving layout
    (q|k|v and gate|up one projection each)."""
    model, tok, adapters = parts
    if fused:
        model = build_model(model.config, model.flat_params(), fused=True)
    config = engine_config(max_batch=8, token_budgets=(8, 16, 32), lora=lora, **overrides)
    if lora.bank is LoraBank.UNIFIED:
        pager = UnifiedPager(model.config, lora, page_size=config.page_size, dtype=model.dtype, host_memory=host_memory)
    else:
        pager = Pager(model.config, lora, dtype=model.dtype)
    for name, adapter in adapters.items():
        pager.register(name, adapter)
    engine = Engine(model, tok, config, pager)
    if nan_pool:
        engine.runner.kv = jax.tree.map(lambda x: x + jnp.nan, engine.runner.kv)
    if warm:
        engine.warmup()
    return engine


def pages_of(parts, name: str) -> int:
    model, _, adapters = parts
    ranks = {m: (adapters[name].weights[m][0].shape[-1] if m in adapters[name].weights else 0) for m in TARGET_MODULES}
    return adapter_layout(ranks, model.config, UNIFIED, PAGE_SIZE).num_pages


@pytest.fixture(scope="module")
def padded_tokens(parts):
    return [out.token_ids for out in make_engine(parts, PADDED, nan_pool=False).generate(requests(MIXED))]


@pytest.mark.parametrize(
    "lora, tiled_from, fused",
    [
        (UNIFIED, None, False),
        (UNIFIED_PALLAS, None, False),
        (UNIFIED_PALLAS, 16, False),
        (UNIFIED_PALLAS, None, True),
        (UNIFIED_PALLAS, 16, True),
    ],
    ids=["xla", "pallas", "pallas-tiled", "pallas-fused", "pallas-fused-tiled"],
)
def test_mixed_ranks_same_tokens_as_the_padded_bank_with_a_nan_pool(
    parts, padded_tokens, lora, tiled_from, fused, monkeypatch, request
):
    """pallas-tiled: steps of 16 and 32 token rows run the tiled kernels (rows grouped by adapter),
    steps of 8 the per-row ones, in one engine. pallas-fused: the serving layout, whose q|k|v and
    gate|up groups take one per-row shrink and one expand each (every module's columns in one y);
    pallas-fused-tiled: the same layout with steps of 16 and 32 rows on the tiled kernels, a module
    at a time in its columns of the fused output."""
    if tiled_from is not None:
        # Steps traced under another threshold would be reused (it is not in their key), both ways.
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)
        monkeypatch.setattr(apply, "UNIFIED_TILED_MIN_TOKENS", tiled_from)
        calls = []
        real = apply.unified_tiled_shrink
        monkeypatch.setattr(apply, "unified_tiled_shrink", lambda *a, **k: calls.append(1) or real(*a, **k))
    groups = []
    if fused:
        jax.clear_caches()
        request.addfinalizer(jax.clear_caches)
        real_expand = apply.unified_expand
        monkeypatch.setattr(
            apply, "unified_expand", lambda *a, **k: groups.append(len(k["columns"])) or real_expand(*a, **k)
        )
    engine = make_engine(parts, lora, fused=fused)
    with jax.no_tracing():
        got = [out.token_ids for out in engine.generate(requests(MIXED))]
    assert got == padded_tokens
    assert engine.compiles_after_warmup == 0
    engine.pager.check()
    engine.pages.check()
    # Every adapter of the batch stayed resident in KV pages; sequences gave theirs back.
    usage = engine.pager.pool_usage()
    assert usage["adapter_pages"] == sum(pages_of(parts, n) for n in set(MIXED) - {None})
    assert engine.pages.num_owned == usage["adapter_pages"]
    if tiled_from is not None:
        assert calls, "no step traced the tiled kernels"
    if fused:  # q|k|v (3 modules) and gate|up (2) each in one expand, o and down alone
        assert sorted(set(groups)) == [1, 2, 3], groups


@pytest.mark.parametrize("lora", [UNIFIED, UNIFIED_PALLAS], ids=["xla", "pallas"])
def test_the_compiled_step_never_copies_the_pool(parts, lora):
    """Adapter terms read the pool before and after each layer's in-place KV write: the compiled step
    must order those reads, not copy the pool (a copy per layer would cost more than the step). The
    padded bank's step is the control."""
    from jaxlora.engine.scheduler import StepPlan

    for bank in (PADDED, lora):
        engine = make_engine(parts, bank, nan_pool=False, warm=False, num_pages=300)
        runner = engine.runner
        inputs = runner.packer.pack(StepPlan(chunks=(), budget=8, needs_commit=False), engine.pages)
        text = runner._lower(engine.pager.bank, jax.device_put(inputs.buffer), inputs.layout, True).compile().as_text()
        shape = ",".join(map(str, runner.kv.k.shape))
        flat = f"{runner.kv.k.shape[0]},{runner.kv.k[0].size}"
        copies = [line for line in text.splitlines() if re.search(rf"= f32\[({shape}|{flat})\]\S* copy\(", line)]
        assert not copies, (bank.bank, copies[:4])


def test_device_bytes_follow_the_rank(parts):
    engine = make_engine(parts, UNIFIED, nan_pool=False, warm=False)
    pager = engine.pager
    for name in ("r8", "r64", "pattern"):
        pager.acquire(name)
    pager.commit()
    r8, r64 = pager.device_nbytes("r8"), pager.device_nbytes("r64")
    assert 0 < r8 <= (1 / 8 + 0.05) * r64
    config = parts[0].config
    # rank_pattern: q 2, v 16, gate 9, down 64, every other module 0; one run per layer, each factor
    # starting at the next FACTOR_ALIGN multiple.
    run = 0
    for m, r in {"q_proj": 2, "v_proj": 16, "gate_proj": 9, "down_proj": 64}.items():
        for width in config.module_shape(m):
            run = -(-run // FACTOR_ALIGN) * FACTOR_ALIGN + r * width
    seg = PAGE_SIZE * config.num_kv_heads * config.head_dim
    assert pager.device_nbytes("pattern") == -(-run // (2 * seg)) * 2 * seg * config.num_layers * 4
    assert pager.pool_usage()["adapter_bytes"] == r8 + r64 + pager.device_nbytes("pattern")
    pager.check()


def test_idle_adapters_give_their_pages_back_to_sequences(parts):
    """The pool holds r64 and r16 and 40 pages more. Once their requests finish, every page counts
    as free (the engine without adapters' figure), and base-model requests needing 72 pages run to
    the end without a preemption: the idle adapters are reclaimed, least recently used first."""
    num_pages = pages_of(parts, "r64") + pages_of(parts, "r16") + 40
    engine = make_engine(parts, UNIFIED, num_pages=num_pages)
    engine.generate(requests(["r64", "r16"]))
    assert engine.pager.pool_usage()["adapter_pages"] == num_pages - 40
    assert engine.pages.num_free == num_pages  # idle adapters' pages are free for sequences
    outs = engine.generate(requests([None] * 8, seed=3, max_tokens=30))
    assert all(len(o.token_ids) == 30 for o in outs)
    stats = engine.stats()
    assert stats["preemptions"] == 0 and stats["pager"]["reclaimed"] >= 1
    assert engine.pager.slot_of("r64") is None  # the least recently used went first
    engine.pager.check()
    engine.pages.check()


def test_sequences_never_reclaim_an_adapter_in_use(parts):
    """r64 serves a long request while base-model sequences want more pages than are free: the
    scheduler preempts sequences (r64's included) instead of taking r64's pages, and every request
    ends with the tokens a padded bank gives."""
    names = ["r64", None, None, None, None]
    want = [
        o.token_ids for o in make_engine(parts, PADDED, nan_pool=False).generate(requests(names, seed=7, max_tokens=30))
    ]
    engine = make_engine(parts, UNIFIED, num_pages=pages_of(parts, "r64") + 24)
    got = [o.token_ids for o in engine.generate(requests(names, seed=7, max_tokens=30))]
    assert got == want
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["pager"]["reclaimed"] == 0
    engine.pager.check()
    engine.pages.check()


def test_an_adapter_waits_for_pages_and_never_takes_a_sequences(parts, padded_tokens):
    """Base-model sequences hold the pages r64 would need: its request waits, taking nothing, and
    runs once they finish, with the padded bank's tokens."""
    num_pages = pages_of(parts, "r64") + 20  # 20 steps in, the base sequences hold about 26
    engine = make_engine(parts, UNIFIED, num_pages=num_pages)
    base = [engine.submit(r) for r in requests([None] * 4, seed=5, max_tokens=30)]
    for _ in range(20):
        engine.step()
    assert engine.pages.num_takeable < pages_of(parts, "r64")  # r64 cannot be placed now
    (r64,) = [r for r in requests(MIXED) if r.adapter == "r64"]
    handle = engine.submit(r64)
    waited = False
    while engine.has_work():
        engine.step()
        snapshot = engine.pager.snapshot()
        waited |= snapshot["waiting"] == ["r64"]
        held = {p for seq in range(8) for p in engine.pages.pages_of(seq)}
        assert not held & set(engine.pages.owned(engine.pager._owner_of.get("r64", "")))
        engine.pages.check()
        engine.pager.check()
    assert waited
    assert all(len(h.result(0).token_ids) == 30 for h in base)
    assert handle.result(0).token_ids == padded_tokens[MIXED.index("r64")]


def test_no_compiles_after_warmup_as_adapters_page_in_and_out(parts, padded_tokens):
    """A pool of r64, r16 and 40 pages more, smaller than the mixed batch's adapters together: they
    evict one another, and the tokens stay the padded bank's."""
    num_pages = pages_of(parts, "r64") + pages_of(parts, "r16") + 40
    assert sum(pages_of(parts, n) for n in set(MIXED) - {None}) > num_pages
    engine = make_engine(parts, UNIFIED, num_pages=num_pages, max_adapters_per_batch=2)
    with jax.no_tracing():
        got = [out.token_ids for out in engine.generate(requests(MIXED))]
    assert got == padded_tokens
    assert engine.pager.metrics.evictions > 0
    assert engine.compiles_after_warmup == 0
    engine.pager.check()
    engine.pages.check()


def test_a_lost_pool_rewrites_pinned_adapters_and_evicts_idle_ones(parts, padded_tokens):
    engine = make_engine(parts, UNIFIED)
    engine.generate(requests(MIXED))  # every adapter of MIXED resident and idle
    pager = engine.pager
    pager.acquire("r8")  # pinned, as a waiting request's would be
    engine._fail_all("injected device loss")  # resets the KV pool; the pager hears of it
    assert pager.slot_of("r4") is None and not pager.is_ready("r8") and pager.slot_of("r8") is not None
    pager.commit()
    assert pager.is_ready("r8")
    pages = pager._pages_of["r8"]
    flat = pager.host_adapter("r8").pages()
    kv = engine.runner.kv
    np.testing.assert_array_equal(np.asarray(kv.k[:, pages]), flat[:, :, 0])
    np.testing.assert_array_equal(np.asarray(kv.v[:, pages]), flat[:, :, 1])
    pager.release("r8")
    with jax.no_tracing():
        got = [out.token_ids for out in engine.generate(requests(MIXED))]
    assert got == padded_tokens
    pager.check()
    engine.pages.check()


def test_adapters_the_last_prefetch_named_are_not_offered_to_sequences(parts):
    """A waiting request's adapter, paged in ahead by prefetch, is about to be read: sequences may
    not take its pages (that would page it out and in again, step after step)."""
    engine = make_engine(parts, UNIFIED, nan_pool=False)
    pager, total = engine.pager, engine.pages.num_pages
    pager.prefetch(["r16"])
    pager.commit()
    assert pager.is_ready("r16") and engine.pages.num_free == total - pages_of(parts, "r16")
    pager.prefetch([])
    assert engine.pages.num_free == total
    pager.check()


def test_unregistering_on_another_thread_gives_pages_back_on_the_engine_thread(parts):
    engine = make_engine(parts, UNIFIED, nan_pool=False)
    engine.generate(requests(["r16"]))
    held = engine.pages.num_owned
    assert held == pages_of(parts, "r16")
    thread = threading.Thread(target=engine.unregister_adapter, args=("r16",))
    thread.start()
    thread.join()
    assert engine.pages.num_owned == held  # not touched off the engine thread
    engine.step()
    assert engine.pages.num_owned == 0 and engine.pages.num_free == engine.pages.num_pages
    engine.pager.check()
    engine.pages.check()


def test_an_adapter_that_would_leave_no_room_for_a_sequence_is_refused(parts):
    """Pinned adapters never take the room of one max_seq_len sequence and the reserve: a request
    on r64 in a pool of r64's pages and two more would wait for good (its pinned adapter holds the
    pages its sequence needs), so r64 is refused when the engine is made, with the figures."""
    with pytest.raises(AdapterError, match="beside one max_seq_len sequence"):
        make_engine(parts, UNIFIED, num_pages=pages_of(parts, "r64") + 2, warm=False)


def test_built_from_a_config_and_an_adapter_larger_than_the_pool_is_refused(parts):
    model, tok, adapters = parts
    config = engine_config(lora=UNIFIED, num_pages=pages_of(parts, "r16") + 8)
    engine = build_engine(config, model, tok, {"r8": adapters["r8"]})
    assert isinstance(engine.pager, UnifiedPager) and engine.pager.max_pages >= pages_of(parts, "r64")
    with pytest.raises(AdapterError, match="KV pages"):
        engine.register_adapter("r64", adapters["r64"])
    with pytest.raises(AdapterError, match="KV pages the pool can give an adapter beside one max_seq_len"):
        build_engine(config, model, tok, {"r64": adapters["r64"]})


@pytest.mark.parametrize("host_memory", ["auto", "pinned"])
def test_host_copies_are_runs_of_compiled_page_counts_and_page_in_as_they_are(parts, host_memory):
    """Each adapter's host copy is its packed pages cut into runs the page write is compiled for
    (no padding copy at page-in), numpy or pinned_host as asked (the GPU default), and its pages
    land in the pool as packed, whatever the run count, with no compile after warm-up."""
    engine = make_engine(parts, UNIFIED, host_memory=host_memory)
    pager, (model, _, adapters) = engine.pager, parts
    counts = {name: pages_of(parts, name) for name in adapters}
    assert any(len(page_runs(n, pager._sizes)) > 1 for n in counts.values())  # some adapter takes several runs
    for name, n in counts.items():
        stored = pager.host_adapter(name)
        assert tuple(run.shape[1] for run in stored.flat) == page_runs(n, pager._sizes)
        if host_memory == "auto":  # numpy on the CPU
            assert all(isinstance(run, np.ndarray) and run.flags.c_contiguous for run in stored.flat)
        else:
            assert all(run.sharding.memory_kind == "pinned_host" for run in stored.flat)
        packed = pack_run(adapters[name].weights, stored.unified, model.config, PAGE_SIZE, pager.dtype)
        np.testing.assert_array_equal(stored.pages(), packed)
        assert stored.nbytes == packed.nbytes
    with jax.no_tracing():  # every run's write was compiled at warm-up
        for name in counts:
            pager.acquire(name)
        pager.commit()
    kv = engine.runner.kv
    for name in counts:
        pages, want = pager._pages_of[name], pager.host_adapter(name).pages()
        np.testing.assert_array_equal(np.asarray(kv.k[:, pages]), want[:, :, 0])
        np.testing.assert_array_equal(np.asarray(kv.v[:, pages]), want[:, :, 1])
    pager.check()


def test_page_runs_cut_a_count_into_compiled_counts_largest_first():
    sizes = page_counts(76)
    assert sizes == (1, 2, 4, 8, 16, 32, 64, 76)
    assert page_runs(76, sizes) == (76,) and page_runs(75, sizes) == (64, 8, 2, 1)
    assert page_runs(1, sizes) == (1,) and page_runs(64, sizes) == (64,)
    assert all(sum(page_runs(n, sizes)) == n and set(page_runs(n, sizes)) <= set(sizes) for n in range(1, 77))
    for bad in (0, 77):
        with pytest.raises(ValueError, match="pages: need 1 to 76"):
            page_runs(bad, sizes)
