"""The engine with many more adapters than device slots: paging must be invisible in the tokens."""

import dataclasses
import json
import threading

import jax
import numpy as np
import pytest

from jaxlora.adapters import Pager
from jaxlora.engine import Engine, GenerationRequest, SamplingParams
from jaxlora.errors import AdapterError, UnknownAdapterError
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.lora.peft_format import save_peft_adapter
from tests.engine.conftest import engine_config
from tests.factories import char_tokenizer, random_adapters, tiny_lora, tiny_model
from tests.greedy import greedy

NUM_REGISTERED, NUM_USED, NUM_REQUESTS, MAX_TOKENS, PROMPT_LEN = 1000, 200, 300, 6, 6


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_model(), char_tokenizer()
    lora = tiny_lora(max_slots=8)  # 7 adapter slots + the base slot
    config = engine_config(max_batch=8, lora=lora, max_wait_steps=16)
    pager = Pager(model.config, lora, dtype=model.dtype)
    adapters = random_adapters(NUM_REGISTERED, model.config, lora, seed=3)
    for adapter in adapters:
        pager.register(adapter.name, adapter)
    engine = Engine(model, tok, config, pager)
    engine.warmup()
    return model, lora, engine, {a.name: a for a in adapters}


def _power_law_requests(seed: int = 0) -> list[GenerationRequest]:
    # S-LoRA's workload: adapter popularity ~ rank^-1 over the adapters in use.
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, NUM_USED + 1)
    picks = rng.choice(NUM_USED, NUM_REQUESTS, p=weights / weights.sum())
    return [
        GenerationRequest(
            request_id=f"r{i}",
            prompt_ids=[int(t) for t in rng.integers(4, 99, PROMPT_LEN)],
            adapter=f"lora-{int(a) * (NUM_REGISTERED // NUM_USED)}",
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
        )
        for i, a in enumerate(picks)
    ]


def test_1000_adapters_8_slots_power_law_traffic_matches_solo_runs(setup):
    model, lora, engine, adapters = setup
    requests = _power_law_requests()
    page_ins_before = engine.pager.metrics.page_ins
    with jax.no_tracing():
        results = engine.generate(requests)
    assert engine.compiles_after_warmup == 0
    page_ins = engine.pager.metrics.page_ins - page_ins_before
    print(
        json.dumps(
            {
                "registered": NUM_REGISTERED,
                "slots": lora.max_slots,
                "requests": len(requests),
                "adapters_used": len({r.adapter for r in requests}),
                "page_ins": page_ins,
                "compiles_after_warmup": engine.compiles_after_warmup,
            }
        )
    )
    assert page_ins >= len({r.adapter for r in requests})

    # Solo reference: each request alone, its adapter the only one in a fresh 2-slot bank.
    bank = init_bank(model.config, lora)
    current = None
    eos = set(engine.tokenizer.eos_token_ids)
    for req, out in sorted(zip(requests, results), key=lambda p: p[0].adapter):
        if req.adapter != current:
            current = req.adapter
            bank = set_slot(bank, 1, slot_arrays(adapters[current].weights, model.config, lora))
        _, expected = greedy(model, list(req.prompt_ids), MAX_TOKENS, bank=bank, slot=1)
        got = list(out.token_ids)
        assert out.error is None, out.error
        assert got == expected[: len(got)], req.request_id
        assert len(got) == MAX_TOKENS or got[-1] in eos, req.request_id
    assert engine.pager.snapshot()["refcounts"] == {}


def test_unregister_in_use_and_corrupt_register_leave_others_unaffected(setup, tmp_path):
    model, lora, engine, adapters = setup
    req = GenerationRequest(
        request_id="busy", prompt_ids=[1, 40, 41], adapter="lora-5", sampling=SamplingParams(max_tokens=MAX_TOKENS)
    )
    other = GenerationRequest(
        request_id="other", prompt_ids=[1, 50, 51], adapter="lora-10", sampling=SamplingParams(max_tokens=MAX_TOKENS)
    )
    expected = engine.generate([other])[0].token_ids
    busy = engine.submit(req)
    engine.step()  # lora-5 is now pinned by a running request
    waiter = threading.Thread(target=engine.unregister_adapter, args=("lora-5",), kwargs={"timeout": 60})
    waiter.start()

    # A corrupt adapter (NaN weights) is refused while serving; nothing else changes.
    w = adapters["lora-7"].weights
    bad = {m: (np.full_like(a, np.nan), b) for m, (a, b) in w.items()}
    save_peft_adapter(tmp_path / "bad", weights=bad, rank=adapters["lora-7"].rank, alpha=8)
    with pytest.raises(AdapterError, match="NaN|non-finite|finite"):
        engine.register_adapter("bad", tmp_path / "bad")

    second = engine.submit(other)
    engine.run_until_idle()
    waiter.join(60)
    assert not waiter.is_alive()
    assert busy.result(0).error is None and len(busy.result(0).token_ids) >= 1
    assert second.result(0).token_ids == expected
    with pytest.raises(UnknownAdapterError):
        engine.submit(GenerationRequest(request_id="gone", prompt_ids=[1, 2], adapter="lora-5"))
    assert engine.generate([other])[0].token_ids == expected
    assert not engine.pager.has("bad")


def test_uniform_traffic_keeps_the_all_resident_schedule(setup):
    """Uniform popularity over 1,000 adapters (nearly every request cold), all submitted at once so
    every request outwaits max_wait_steps: the paged engine runs exactly the steps and computes the tokens
    of the same engine with every adapter resident. A page-in costs a new request no step (it is
    admitted in the step that pages its adapter in), and a starving request with a queued page-in
    does not hold back the requests behind it."""
    model, lora, engine, adapters = setup
    rng = np.random.default_rng(7)
    registered = [n for n in sorted(adapters) if engine.pager.has(n)]  # an earlier test unregisters one
    picks = rng.choice(registered, 96)
    prompts = [[int(t) for t in rng.integers(4, 99, PROMPT_LEN)] for _ in picks]

    def run(eng, names):
        requests = [
            GenerationRequest(
                request_id=f"u{i}", prompt_ids=p, adapter=n, sampling=SamplingParams(max_tokens=MAX_TOKENS)
            )
            for i, (p, n) in enumerate(zip(prompts, names))
        ]
        before = eng.stats()
        with jax.no_tracing():
            results = eng.generate(requests)
        assert all(r.error is None for r in results)
        return {k: eng.stats()[k] - before[k] for k in ("steps", "decode_tokens", "prefill_tokens", "padded_tokens")}

    no_eos = dataclasses.replace(engine.tokenizer, eos_token_ids=())  # every request runs to max_tokens
    # As many rows as slots: with fewer slots, distinct adapters, not paging, would cap the batch.
    config = dataclasses.replace(engine.config, max_batch=lora.max_slots - 1)
    resident = Pager(model.config, lora, dtype=model.dtype)
    names = sorted(adapters)[: lora.max_slots - 1]
    for name in names:
        resident.register(name, adapters[name])
    resident.prefetch(names)
    resident.commit()
    resident_engine = Engine(model, no_eos, config, resident)
    resident_engine.warmup()
    paged_engine = Engine(model, no_eos, config, engine.pager)  # the 1,000 registered adapters
    paged_engine.warmup()
    want = run(resident_engine, [names[i % len(names)] for i in range(len(picks))])
    got = run(paged_engine, [str(n) for n in picks])
    assert got == want


def test_adapters_of_every_rank_class_page_in_and_match_solo_runs():
    """A rank-8 bank (classes 4 and 8) with adapters of ranks 1-8 over 3 slots: every page-in widens
    its class copy on the device, evictions put small classes over large ones and back, and each
    request's tokens equal its solo run with the adapter padded straight to R; nothing compiles."""
    model, tok = tiny_model(), char_tokenizer()
    lora = tiny_lora(max_slots=4, max_rank=8)
    pager = Pager(model.config, lora, dtype=model.dtype)
    adapters = {a.name: a for a in random_adapters(9, model.config, lora, seed=21)}
    assert {a.rank <= 4 for a in adapters.values()} == {True, False}  # both classes are used
    for adapter in adapters.values():
        pager.register(adapter.name, adapter)
    engine = Engine(model, tok, engine_config(max_batch=4, lora=lora), pager)
    engine.warmup()
    rng = np.random.default_rng(5)
    requests = [
        GenerationRequest(
            request_id=f"c{i}",
            prompt_ids=[int(t) for t in rng.integers(4, 99, PROMPT_LEN)],
            adapter=f"lora-{i % len(adapters)}",
            sampling=SamplingParams(max_tokens=MAX_TOKENS),
        )
        for i in range(2 * len(adapters))
    ]
    with jax.no_tracing():
        results = engine.generate(requests)
    assert engine.compiles_after_warmup == 0
    assert pager.registered_bytes < len(adapters) * pager.slot_nbytes  # the rank-4 class is half a slot
    eos = set(tok.eos_token_ids)
    for req, out in zip(requests, results):
        bank = set_slot(
            init_bank(model.config, lora), 1, slot_arrays(adapters[req.adapter].weights, model.config, lora)
        )
        _, expected = greedy(model, list(req.prompt_ids), MAX_TOKENS, bank=bank, slot=1)
        got = list(out.token_ids)
        assert out.error is None, out.error
        assert got == expected[: len(got)] and (len(got) == MAX_TOKENS or got[-1] in eos), req.request_id
