"""The engine end to end on a tiny random model: continuous batching of mixed-adapter traffic gives
each request exactly its solo greedy tokens, with zero compiles after warm-up."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.engine.config import EngineConfig
from jaxlora.engine.request import FinishReason, GenerationRequest, SamplingParams
from jaxlora.errors import CapacityError, RequestError, UnknownAdapterError
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.model import init_kv_cache
from tests.engine.conftest import ADAPTERS, engine_config, make_engine

PRINTABLE_IDS = np.arange(4, 99)


def traffic(n: int, seed: int = 0) -> list[GenerationRequest]:
    """Every adapter and the base model, prompts of 1..30 tokens (some chunked), 1..24 new tokens."""
    rng = np.random.default_rng(seed)
    adapters = [None, *ADAPTERS]
    out = []
    for i in range(n):
        prompt = [1, *rng.choice(PRINTABLE_IDS, int(rng.integers(0, 30))).tolist()]
        out.append(
            GenerationRequest(
                request_id=f"r{i}",
                prompt_ids=prompt,
                adapter=adapters[i % len(adapters)],
                sampling=SamplingParams(max_tokens=int(rng.integers(1, 25))),
            )
        )
    return out


def reference_greedy(parts, request: GenerationRequest) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step: no cache reuse, no batching, its
    own bank with the adapter alone in slot 1."""
    model, tok, adapters = parts
    lora = engine_config().lora
    bank = init_bank(model.config, lora)
    slot = 0
    if request.adapter:
        bank = set_slot(bank, 1, slot_arrays(adapters[request.adapter].weights, model.config, lora))
        slot = 1
    T = 64

    @jax.jit
    def next_token(params, bank, tokens, length, slot):
        mod = nnx.merge(model.graphdef, params)
        kv = init_kv_cache(model.config, 1, T)
        hidden, _ = mod(tokens[None], jnp.arange(T)[None], kv, bank=bank, slot_ids=slot[None])
        return jnp.argmax(mod.logits(hidden[0, length - 1]))

    ids = list(request.prompt_ids)
    out = []
    for _ in range(request.sampling.max_tokens):
        padded = np.zeros(T, np.int32)
        padded[: len(ids)] = ids
        t = int(next_token(model.params, bank, padded, np.int32(len(ids)), np.int32(slot)))
        out.append(t)
        if t in tok.eos_token_ids:
            break
        ids.append(t)
    return out


def test_mixed_traffic_matches_solo_runs_with_zero_compiles(engine, parts):
    requests = traffic(16)
    with jax.no_tracing():
        handles = [engine.submit(r) for r in requests[:6]]
        for _ in range(3):
            engine.step()
        handles += [engine.submit(r) for r in requests[6:11]]  # arrivals while others decode
        for _ in range(4):
            engine.step()
        handles += [engine.submit(r) for r in requests[11:]]
        engine.run_until_idle()
        batched = [h.result(0) for h in handles]
        solo = [engine.generate([r])[0] for r in requests]
    assert engine.compiles_after_warmup == 0
    for r, b, s in zip(requests, batched, solo):
        assert b.token_ids == s.token_ids, r.request_id
        assert b.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert b.completion_tokens == len(b.token_ids) <= r.sampling.max_tokens
    # Paging happened (5 adapters, 3 slots) and the rows really used their adapters.
    stats = engine.stats()
    assert stats["pager"]["page_ins"] >= len(ADAPTERS) and stats["running"] == stats["waiting"] == 0
    assert engine.pager.snapshot()["refcounts"] == {}
    for i in (0, 1, 2):  # the base model and two adapters against a cache-free reference
        assert list(batched[i].token_ids) == reference_greedy(parts, requests[i]), requests[i].request_id
    same_prompt = [
        GenerationRequest(
            request_id=f"p{a}", prompt_ids=[1, 40, 41, 42], adapter=a, sampling=SamplingParams(max_tokens=8)
        )
        for a in (None, *ADAPTERS)
    ]
    outs = engine.generate(same_prompt)
    assert len({o.token_ids for o in outs}) == len(outs), "adapters must change the greedy tokens"


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    hot = SamplingParams(max_tokens=12, temperature=1.3, top_p=0.95, top_k=40, seed=7)
    req = GenerationRequest(request_id="s", prompt_ids=[1, 50, 60, 70], adapter="a1", sampling=hot)
    alone = engine.generate([req])[0]
    crowd = traffic(5, seed=3) + [req]
    with_others = engine.generate(crowd)[-1]
    assert alone.token_ids == with_others.token_ids
    other_seed = engine.generate(
        [
            GenerationRequest(
                request_id="s2",
                prompt_ids=[1, 50, 60, 70],
                adapter="a1",
                sampling=SamplingParams(max_tokens=12, temperature=1.3, top_p=0.95, top_k=40, seed=8),
            )
        ]
    )[0]
    assert other_seed.token_ids != alone.token_ids


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.0, top_k=5, top_p=0.5, seed=3),  # temperature 0 is greedy whatever else is set
        dict(temperature=2.0, top_k=1, seed=4),  # top-k 1 is greedy
        dict(temperature=0.7, top_p=1e-6, seed=5),  # top-p that keeps only the best token is greedy
    ],
)
def test_degenerate_sampling_equals_greedy(engine, sampling):
    prompt = [1, 44, 73, 80, 80, 83]
    greedy = engine.generate(
        [GenerationRequest(request_id="g", prompt_ids=prompt, adapter="a2", sampling=SamplingParams(max_tokens=10))]
    )[0]
    sampled = engine.generate(
        [
            GenerationRequest(
                request_id="x", prompt_ids=prompt, adapter="a2", sampling=SamplingParams(max_tokens=10, **sampling)
            )
        ]
    )[0]
    assert sampled.token_ids == greedy.token_ids


def test_stop_strings_cut_the_text_exactly_and_stream_consistently(engine):
    base = GenerationRequest(request_id="full", prompt="Hello", sampling=SamplingParams(max_tokens=24))
    full = engine.generate([base])[0]
    text = full.text
    assert len(text) >= 8, text
    stop = text[4:6]
    cut = text[: text.index(stop)]
    streamed = []
    req = GenerationRequest(
        request_id="cut", prompt="Hello", sampling=SamplingParams(max_tokens=24, stop=("zzzzz", stop))
    )
    handle = engine.submit(req, callback=streamed.append, stream=True)
    engine.run_until_idle()
    out = handle.result(0)
    assert out.text == cut and out.finish_reason is FinishReason.STOP
    assert "".join(o.text for o in streamed) == cut and streamed[-1].finished
    assert all(not o.finished for o in streamed[:-1])
    assert list(handle) == streamed  # the handle streams the same updates
    # With a callback and no stream=True the handle keeps no updates: iterating it is refused.
    quiet = engine.submit(dataclasses.replace(req, request_id="quiet"), callback=lambda out: None)
    engine.run_until_idle()
    assert quiet.result(0).text == cut
    with pytest.raises(RuntimeError, match="stream=True"):
        next(iter(quiet))
    # A stop token id ends generation at that token.
    stop_id = full.token_ids[3]
    first = full.token_ids.index(stop_id)
    out = engine.generate(
        [
            GenerationRequest(
                request_id="sid", prompt="Hello", sampling=SamplingParams(max_tokens=24, stop_token_ids=(stop_id,))
            )
        ]
    )[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason is FinishReason.STOP
    assert out.text == text[:first]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(prompt_ids=[1] * 60, sampling=SamplingParams(max_tokens=8)), RequestError, "max_seq_len"),
        (dict(prompt="hi", sampling=SamplingParams(max_tokens=33)), RequestError, "limit"),
        (dict(prompt="hi", adapter="nope"), UnknownAdapterError, "nope"),
        (dict(prompt_ids=[1, 500]), RequestError, "500"),
        (dict(prompt_ids=[]), RequestError, "empty"),
    ],
)
def test_bad_requests_fail_alone(engine, kwargs, error, match):
    kwargs = {"prompt_ids": None, **kwargs}
    good = engine.submit(
        GenerationRequest(request_id="good", prompt_ids=[1, 5, 6], sampling=SamplingParams(max_tokens=3))
    )
    with pytest.raises(error, match=match):
        engine.submit(GenerationRequest(request_id="bad", **{k: v for k, v in kwargs.items() if v is not None}))
    engine.run_until_idle()
    assert good.result(0).finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(seed=1.5), "seed=1.5"),
        (dict(stop=("",)), "stop"),
        # Non-finite, or finite but past float32 (the sampler's type): 0 * inf is NaN, which argmax picks.
        (dict(repetition_penalty=float("inf")), "repetition_penalty=inf must be a finite"),
        (dict(repetition_penalty=1e39), "repetition_penalty=1e\\+39 must be a finite"),
        (dict(temperature=float("inf")), "temperature=inf"),
        (dict(top_p=float("nan")), "top_p=nan"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty=-inf"),
    ],
)
def test_sampling_params_name_the_bad_value(kwargs, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


def test_cancel_frees_row_and_adapter_pin(engine):
    long_ = GenerationRequest(
        request_id="long", prompt_ids=[1, 9, 9], adapter="a3", sampling=SamplingParams(max_tokens=32)
    )
    engine.run_until_idle()
    handle = engine.submit(long_)
    for _ in range(4):
        engine.step()
    assert engine.stats()["running"] == 1
    assert engine.cancel("long") and not engine.cancel("never-submitted")
    engine.step()
    out = handle.result(0)
    assert out.finish_reason is FinishReason.CANCELLED and 0 < out.completion_tokens < 32
    assert engine.stats()["running"] == 0 and engine.pager.snapshot()["refcounts"] == {}


def test_queue_full_raises_capacity_error(parts):
    small = make_engine(parts, max_queue=2)  # same shapes: shares the compiled steps
    reqs = [
        GenerationRequest(request_id=f"q{i}", prompt_ids=[1, 7], sampling=SamplingParams(max_tokens=2))
        for i in range(3)
    ]
    small.submit(reqs[0])
    small.submit(reqs[1])
    with pytest.raises(CapacityError):
        small.submit(reqs[2])
    with pytest.raises(RequestError, match="in flight"):
        small.submit(reqs[0])
    small.run_until_idle()
    small.submit(reqs[2])
    small.run_until_idle()
    assert small.compiles_after_warmup == 0


def record_calls(monkeypatch, events: list[str], *targets) -> None:
    """Wraps each (object, attribute) callable so that every call appends the attribute's name to events."""
    for obj, name in targets:
        fn = getattr(obj, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            events.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapped)


def test_page_ins_are_staged_before_the_step_and_committed_around_it(parts, monkeypatch):
    """stage() (copies start) runs before the step is dispatched; commit() (slot writes) runs after
    the dispatch, or before it when the step reads a slot those copies fill; the sampled ids are
    fetched last; a step with nothing to run still stages and commits, so waiting requests progress."""
    engine = make_engine(parts)  # its own engine: the shared one is stopped by the background-loop test
    events: list[str] = []
    record_calls(
        monkeypatch,
        events,
        (engine.pager, "stage"),
        (engine.pager, "commit"),
        (engine.runner, "dispatch"),
        (jax, "device_get"),
    )
    engine.run_until_idle()
    events.clear()
    engine.step()  # idle: nothing dispatched, the page-ins still go out
    assert events == ["stage", "commit"]
    # Every adapter in turn (5 adapters, 3 slots): requests wait for page-ins, then run.
    requests = [
        GenerationRequest(
            request_id=f"order{i}", prompt_ids=[1, 30 + i, 31], adapter=a, sampling=SamplingParams(max_tokens=3)
        )
        for i, a in enumerate(ADAPTERS)
    ]
    page_ins = engine.pager.metrics.page_ins
    with jax.no_tracing():
        for out in engine.generate(requests):
            assert out.error is None and out.completion_tokens >= 1
    assert engine.pager.metrics.page_ins > page_ins and engine.compiles_after_warmup == 0
    # Each step: stage, then the commit before or after the one dispatch, then (one step behind)
    # the read of the previous step's ids.
    steps: list[list[str]] = []
    for e in events:
        if e == "stage":
            steps.append([])
        steps[-1].append(e)
    allowed = {
        ("stage", *c, *r)
        for c in (("commit",), ("dispatch", "commit"), ("commit", "dispatch"))
        for r in ((), ("device_get",))
    }
    assert all(tuple(s) in allowed for s in steps), steps
    dispatching = [s for s in steps if "dispatch" in s]
    assert dispatching and "device_get" not in dispatching[0]  # the first has nothing in flight to read
    # A request for a cold adapter is admitted in the step that pages its adapter in: the commit
    # that writes its slot goes first, then the step with its prompt.
    engine.run_until_idle()
    cold = next(a for a in ADAPTERS if engine.pager.is_ready(a) is None)
    handle = engine.submit(
        GenerationRequest(
            request_id="cold", prompt_ids=[1, 44, 45], adapter=cold, sampling=SamplingParams(max_tokens=2)
        )
    )
    page_ins = engine.pager.metrics.page_ins
    events.clear()
    engine.step()  # pins the adapter (page-in queued), stages the copy, admits, commits, dispatches
    assert events == ["stage", "commit", "dispatch"] and engine.pager.metrics.page_ins == page_ins + 1
    engine.run_until_idle()
    assert handle.result().error is None and handle.result().completion_tokens == 2


def test_engine_runs_one_step_behind(engine, monkeypatch):
    """Step N+1 is dispatched before step N's ids are read; rows are fed their token on the device."""
    events: list[str] = []
    engine.run_until_idle()
    record_calls(monkeypatch, events, (engine.runner, "dispatch"), (jax, "device_get"))
    request = GenerationRequest(request_id="behind", prompt_ids=[1, 20, 21, 22], sampling=SamplingParams(max_tokens=3))
    handle = engine.submit(request)
    assert engine.step() == [] and events == ["dispatch"]  # dispatched, not read
    first = engine.step()  # decode fed the prompt's sampled id on the device, then that id is read
    assert events[1:] == ["dispatch", "device_get"] and [o.completion_tokens for o in first] == [1]
    engine.run_until_idle()
    tokens = handle.result().token_ids
    assert len(tokens) == 3 and engine.compiles_after_warmup == 0
    # max_tokens is known ahead: no step is dispatched past the third token.
    assert events.count("dispatch") == 3
    solo = engine.generate(
        [GenerationRequest(request_id="again", prompt_ids=[1, 20, 21, 22], sampling=SamplingParams(max_tokens=3))]
    )[0]
    assert solo.token_ids == tokens


def test_stats_split_the_loops_host_time_by_phase(engine):
    """Every dispatched step is counted; host time is the sum of its four phases, the wait apart."""
    from jaxlora.engine.host_timing import HOST_PHASES, per_step

    engine.run_until_idle()
    s0 = engine.stats()
    requests = [
        GenerationRequest(request_id=f"timed{i}", prompt_ids=[1, 40 + i], sampling=SamplingParams(max_tokens=5))
        for i in range(3)
    ]
    engine.generate(requests)
    s1 = engine.stats()
    host = s1["host"]
    assert host["steps"] - s0["host"]["steps"] == s1["steps"] - s0["steps"] >= 5
    assert host["calls"] - s0["host"]["calls"] >= host["steps"] - s0["host"]["steps"]
    assert host["host_ms"] == pytest.approx(sum(host[f"{p}_ms"] for p in HOST_PHASES), abs=0.01)
    ms = per_step(s0["host"], s1["host"])
    assert all(ms[f"{p}_ms"] > 0 for p in HOST_PHASES) and ms["wait_ms"] >= 0
    assert per_step(s1["host"], s1["host"])["host_ms"] is None  # no step in between


def test_steps_without_adapter_rows_run_without_the_bank(engine, monkeypatch):
    """A step whose rows are all on the base slot skips the LoRA ops (bank None), with no compile and
    the same tokens; a step with an adapter row keeps the bank."""
    import jaxlora.engine.runner as runner_module

    seen: list[bool] = []
    fn = runner_module.packed_step

    def wrapped(params, bank, *args, **kwargs):
        seen.append(bank is not None)
        return fn(params, bank, *args, **kwargs)

    monkeypatch.setattr(runner_module, "packed_step", wrapped)
    engine.run_until_idle()
    base = GenerationRequest(request_id="base-only", prompt_ids=[1, 9, 10], sampling=SamplingParams(max_tokens=4))
    with jax.no_tracing():
        out = engine.generate([base])[0]
    assert seen and not any(seen) and engine.compiles_after_warmup == 0
    seen.clear()
    mixed = [
        GenerationRequest(request_id="mixed-base", prompt_ids=[1, 9, 10], sampling=SamplingParams(max_tokens=4)),
        GenerationRequest(
            request_id="mixed-a0", prompt_ids=[1, 9, 10], adapter=ADAPTERS[0], sampling=SamplingParams(max_tokens=4)
        ),
    ]
    with jax.no_tracing():
        outs = engine.generate(mixed)
    assert any(seen) and engine.compiles_after_warmup == 0
    assert outs[0].token_ids == out.token_ids  # the base row is unchanged by sharing a step with an adapter row


@pytest.mark.parametrize("prefetch", [16, 0])
def test_waiting_requests_adapters_are_prefetched_while_rows_are_busy(parts, prefetch):
    """With every row busy, the adapters of waiting requests are paged in ahead (unpinned), so the
    requests start on resident slots when rows free up; prefetch_adapters=0 turns it off."""
    engine = make_engine(parts, prefetch_adapters=prefetch)
    busy = [
        GenerationRequest(
            request_id=f"busy{i}", prompt_ids=[1, 40 + i], adapter="a0", sampling=SamplingParams(max_tokens=12)
        )
        for i in range(engine.config.max_batch)
    ]
    later = [
        GenerationRequest(
            request_id=f"later{a}", prompt_ids=[1, 50, 51], adapter=a, sampling=SamplingParams(max_tokens=2)
        )
        for a in ("a1", "a2")
    ]
    handles = [engine.submit(r) for r in busy]
    engine.step()  # takes them in; their adapter's page-in is issued
    while engine.scheduler.num_waiting:
        engine.step()
    handles += [engine.submit(r) for r in later]
    for _ in range(2):
        engine.step()
    assert engine.scheduler.num_waiting == 2  # rows still busy
    prefetched = [engine.pager.is_ready(a) is not None for a in ("a1", "a2")]
    assert prefetched == [bool(prefetch)] * 2
    assert (engine.pager.metrics.prefetches >= 2) == bool(prefetch)
    hits = engine.pager.metrics.hits
    engine.run_until_idle()
    assert all(h.result().error is None for h in handles)
    assert (engine.pager.metrics.hits - hits >= 2) == bool(prefetch)
    assert engine.compiles_after_warmup == 0


def test_prefetch_adapters_flag_and_validation():
    import argparse

    from jaxlora.cli.engine_args import add_engine_args
    from jaxlora.cli.engine_args import engine_config as config_from_args
    from jaxlora.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args([])).prefetch_adapters == EngineConfig().prefetch_adapters == 16
    assert config_from_args(p.parse_args(["--prefetch-adapters", "0"])).prefetch_adapters == 0
    with pytest.raises(ValueError, match="prefetch_adapters=-1"):
        config_from_args(p.parse_args(["--prefetch-adapters", "-1"]))


def test_prompts_around_page_and_budget_edges_match_solo_runs(engine, parts):
    """Prompt lengths 1, page - 1, page, page + 1 and past the largest token budget (prefilled over
    several steps), arriving while others decode, each equal to its greedy solo recomputation."""
    page, largest = engine.config.page_size, engine.config.token_budgets[-1]
    lengths = [1, page - 1, page, page + 1, largest + 3, 2 * largest + 1]
    rng = np.random.default_rng(11)
    requests = [
        GenerationRequest(
            request_id=f"edge{n}",
            prompt_ids=[1, *rng.choice(PRINTABLE_IDS, n - 1).tolist()],
            adapter=(None, *ADAPTERS)[i % 3],
            sampling=SamplingParams(max_tokens=6),
        )
        for i, n in enumerate(lengths)
    ]
    with jax.no_tracing():
        handles = [engine.submit(r) for r in requests[:3]]
        engine.step()
        engine.step()
        handles += [engine.submit(r) for r in requests[3:]]
        engine.run_until_idle()
    assert engine.compiles_after_warmup == 0
    for r, h in zip(requests, handles):
        assert list(h.result(0).token_ids) == reference_greedy(parts, r), r.request_id


def test_a_pool_too_small_preempts_and_every_request_still_gets_its_solo_tokens(parts):
    """Four rows of up to 40 positions over 20 pages of 4 (a quarter of what they could use): the
    newest running request is preempted and recomputed later; tokens equal the solo runs."""
    engine = make_engine(parts, num_pages=20)
    rng = np.random.default_rng(3)
    requests = [
        GenerationRequest(
            request_id=f"tight{i}",
            prompt_ids=[1, *rng.choice(PRINTABLE_IDS, 14).tolist()],
            adapter=(None, *ADAPTERS)[i % 4],
            sampling=SamplingParams(max_tokens=20),
        )
        for i in range(6)
    ]
    with jax.no_tracing():
        outs = engine.generate(requests)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["free_pages"] == 20 and engine.compiles_after_warmup == 0
    engine.pages.check()
    for r, out in zip(requests, outs):
        assert out.error is None and list(out.token_ids) == reference_greedy(parts, r), r.request_id


def test_non_finite_logits_fail_that_request_alone_naming_its_adapter(engine):
    """An adapter whose device weights are NaN: its request ends with an error naming the adapter
    (never empty text), and a base-model request in the same steps is unaffected."""
    engine.run_until_idle()
    base = GenerationRequest(request_id="finite-base", prompt_ids=[1, 5, 6], sampling=SamplingParams(max_tokens=4))
    expected = engine.generate([base])[0].token_ids
    warm = GenerationRequest(
        request_id="warm-a1", prompt_ids=[1, 5], adapter="a1", sampling=SamplingParams(max_tokens=1)
    )
    engine.generate([warm])
    slot = engine.pager.is_ready("a1")
    clean = engine.pager.bank
    engine.pager.bank = jax.tree.map(lambda x: x.at[:, slot].set(jnp.nan), clean)
    try:
        bad = GenerationRequest(
            request_id="nan-a1", prompt_ids=[1, 5, 6], adapter="a1", sampling=SamplingParams(max_tokens=4)
        )
        # A sampled row goes through the sampler program, which must keep the step's -1 too.
        hot = SamplingParams(max_tokens=4, temperature=0.8, seed=3)
        bad_sampled = GenerationRequest(request_id="nan-a1-hot", prompt_ids=[1, 5, 7], adapter="a1", sampling=hot)
        outs = engine.generate([bad, bad_sampled, dataclasses.replace(base, request_id="finite-base-2")])
    finally:
        engine.pager.bank = clean
    for out in outs[:2]:
        assert out.finish_reason is FinishReason.ERROR and "'a1'" in out.error and "not finite" in out.error
    assert outs[2].error is None and outs[2].token_ids == expected


def test_warmup_reports_each_shape_it_compiles(engine):
    """Warm-up tells which step shape it compiles, k of n: every token budget, with and without the bank,
    and the kernels it runs."""
    seen: list[tuple[str, int, int]] = []
    engine.warmup(progress=lambda what, k, n: seen.append((what, k, n)))
    budgets = engine.config.token_budgets
    assert [(k, n) for _, k, n in seen] == [(k, 2 * len(budgets)) for k in range(1, 2 * len(budgets) + 1)]
    assert all(any(f"{b} tokens" in what for what, _, _ in seen) for b in budgets)
    assert sum("with adapters" in what for what, _, _ in seen) == len(budgets)
    # ... and the kernels each budget's step runs (the engine's one resolved choice).
    for what, _, _ in seen:
        budget = next(b for b in budgets if what.startswith(f"step of {b} tokens"))
        assert what.endswith(f"[{engine.kernels.describe(budget)}]") and "lora=" in what


def test_warmup_compiles_each_step_program_once(parts):
    """Warm-up compiles the step shapes in parallel, then calls each twice, feeding back the pool and
    ids the step returns. Those calls must run the programs it compiled: a fresh pool placed unlike
    a returned one once made every step program compile twice (minutes each on the 7B shape)."""
    from jaxlora.engine.compiles import backend_compiles, compiles_of

    before = compiles_of("packed_step")
    engine = make_engine(parts, token_budgets=(6, 13))  # budgets no other test compiles (jit's cache is global)
    shapes = 2 * len(engine.config.token_budgets)  # with the bank and without
    assert compiles_of("packed_step") - before == shapes
    request = GenerationRequest(request_id="a", prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=3))
    (first,) = engine.generate([request])
    assert compiles_of("packed_step") - before == shapes and engine.compiles_after_warmup == 0
    # A fresh pool after a failed step (reset_pool) is placed the same way: still nothing compiles.
    compiles = backend_compiles()
    engine.runner.reset_pool()
    (again,) = engine.generate([request])
    assert backend_compiles() == compiles and again.token_ids == first.token_ids


def test_without_bank_free_steps_every_step_runs_with_the_bank(engine, parts):
    """bank_free_steps=False: one compile per budget, and base-only steps still give the same tokens."""
    seen: list[tuple[str, int, int]] = []
    lean = make_engine(parts, bank_free_steps=False, progress=lambda what, k, n: seen.append((what, k, n)))
    budgets = lean.config.token_budgets
    assert len(seen) == len(budgets) and all("with adapters" in what for what, _, _ in seen)
    requests = [r for r in traffic(10, seed=3) if r.adapter is None] + traffic(4, seed=4)
    with jax.no_tracing():
        outs = lean.generate(requests)
    assert lean.compiles_after_warmup == 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(requests)]


def test_sampler_runs_only_in_steps_with_a_sampled_row(engine, monkeypatch):
    """Greedy steps end at the step's argmax: the vocabulary-sorting sampler is a program of its own,
    dispatched only for steps where a row samples with a temperature, and compiled at warm-up."""
    import jaxlora.engine.runner as runner_module

    calls: list[int] = []
    fn = runner_module.packed_sample

    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(runner_module, "packed_sample", counted)
    engine.run_until_idle()
    greedy = GenerationRequest(request_id="g-only", prompt_ids=[1, 9, 10], sampling=SamplingParams(max_tokens=5))
    with jax.no_tracing():
        engine.generate([greedy])
    assert calls == [] and engine.compiles_after_warmup == 0
    hot = SamplingParams(max_tokens=5, temperature=0.9, seed=11)
    with jax.no_tracing():
        engine.generate([greedy, GenerationRequest(request_id="hot", prompt_ids=[1, 9, 10], sampling=hot)])
    assert len(calls) == 5 and engine.compiles_after_warmup == 0  # one step per token of the sampled row


def _solo(engine, name: str, **sampling) -> object:
    request = GenerationRequest(request_id=name, prompt_ids=[1, 9, 10, 11], sampling=SamplingParams(**sampling))
    return engine.generate([request])[0]


def test_ignore_eos_and_min_tokens_run_past_what_would_stop(engine, monkeypatch):
    """EOS is made the greedy run's second token (the stop set is read at submit; the sampler's EOS
    ban is static, so it stays the tokenizer's): plain stops there, ignore_eos goes on to max_tokens
    with the same tokens; a stop token id ends nothing before min_tokens tokens. No compiles."""
    engine.run_until_idle()
    plain = _solo(engine, "plain", max_tokens=8)
    assert len(plain.token_ids) == 8, "the tiny model ended early: pick another prompt"
    second = plain.token_ids[1]
    monkeypatch.setattr(engine, "tokenizer", dataclasses.replace(engine.tokenizer, eos_token_ids=(second,)))
    with jax.no_tracing():
        stopped = _solo(engine, "eos", max_tokens=8)
        ignored = _solo(engine, "ignore", max_tokens=8, ignore_eos=True)
    assert stopped.finish_reason is FinishReason.STOP and stopped.token_ids == plain.token_ids[:2]
    assert ignored.finish_reason is FinishReason.LENGTH and ignored.token_ids == plain.token_ids
    monkeypatch.undo()
    first = plain.token_ids[0]
    with jax.no_tracing():
        early = _solo(engine, "stop-id", max_tokens=8, stop_token_ids=(first,))
        held = _solo(engine, "min", max_tokens=8, stop_token_ids=(first,), min_tokens=3)
    assert early.token_ids == (first,) and early.finish_reason is FinishReason.STOP
    assert held.token_ids[:3] == plain.token_ids[:3] and len(held.token_ids) >= 3
    assert engine.compiles_after_warmup == 0


def test_min_tokens_bans_eos_in_the_sampler_for_greedy_rows(engine, monkeypatch):
    """A greedy row below its min_tokens goes through the sampler (EOS banned there), and only
    while it is below: warmed up, no compiles."""
    import jaxlora.engine.runner as runner_module

    calls: list[int] = []
    fn = runner_module.packed_sample
    monkeypatch.setattr(runner_module, "packed_sample", lambda *a, **k: calls.append(1) or fn(*a, **k))
    engine.run_until_idle()
    with jax.no_tracing():
        out = _solo(engine, "min-greedy", max_tokens=6, min_tokens=2)
    assert len(calls) == 2 and len(out.token_ids) == 6 and engine.compiles_after_warmup == 0


def test_step_has_no_conditional(engine):
    """An XLA conditional in the step makes the GPU runtime read its predicate on the host, so the
    host would wait for every step before dispatching the next (the sampler's choice used to be one)."""
    import jaxlora.engine.runner as runner_module

    runner = engine.runner
    layout = next(iter(runner.packer.layouts.values()))
    packed = jnp.zeros(layout.size, jnp.int32)
    args = (runner.params, engine.pager.bank, runner.kv, packed, runner.last_ids)
    hlo = runner_module.packed_step.lower(*args, layout=layout, **runner.step_static).as_text()
    assert "stablehlo.case" not in hlo and "stablehlo.if" not in hlo


# Last in this module: it stops the shared engine for good.
def test_background_loop_serves_threads_and_drains_on_stop(engine):
    requests = traffic(8, seed=5)
    expected = [o.token_ids for o in engine.generate(requests)]
    engine.start()
    try:
        results: dict[str, tuple[int, ...]] = {}

        def client(r):
            results[r.request_id] = engine.submit(r).result(60).token_ids

        threads = [threading.Thread(target=client, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [results[r.request_id] for r in requests] == expected
        assert [o.token_ids for o in engine.generate(requests)] == expected  # generate() on the loop
        late = engine.submit(
            GenerationRequest(request_id="late", prompt_ids=[1, 8], sampling=SamplingParams(max_tokens=20))
        )
    finally:
        engine.stop(drain=True, timeout=60)
    assert late.result(0).finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    with pytest.raises(CapacityError):
        engine.submit(GenerationRequest(request_id="after", prompt_ids=[1, 8]))
    with pytest.raises(CapacityError):  # stopped for good: generate() raises instead of waiting forever
        engine.generate([GenerationRequest(request_id="after", prompt_ids=[1, 8])])


@pytest.mark.parametrize(
    "is_chat, num_prompt, expected",
    [(False, 10, 16), (True, 10, 32), (True, 50, 14), (False, 60, 4)],
)
def test_max_tokens_defaults_as_openai(is_chat, num_prompt, expected):
    from jaxlora.engine.request import default_max_tokens

    # max_seq_len 64, limit 32: chat gets the rest of the context within the limit, completions 16.
    assert default_max_tokens(is_chat=is_chat, num_prompt=num_prompt, max_seq_len=64, max_new_tokens_limit=32) == (
        expected
    )


def test_default_context_is_the_models_within_the_pool():
    """No max_seq_len: the model's own maximum, within what the pool holds; the new-token limit is
    what it leaves after one prompt token. Set sizes stay as they are."""
    config = EngineConfig(max_batch=2, token_budgets=(8,))
    assert config.max_seq_len is None and config.max_new_tokens_limit is None
    derived = config.with_context(model_max=8192, pool_positions=3000)
    assert (derived.max_seq_len, derived.max_new_tokens_limit) == (3000, 2999)
    assert config.with_context(model_max=128, pool_positions=None).max_seq_len == 128
    explicit = EngineConfig(max_seq_len=64, max_new_tokens_limit=32, token_budgets=(8,))
    assert explicit.with_context(model_max=8192, pool_positions=16) == explicit
    with pytest.raises(ValueError, match="no room"):
        config.with_context(model_max=8192, pool_positions=1)
