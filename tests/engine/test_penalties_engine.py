"""Penalties and logprobs through the engine: the on-device token history gives the tokens a
cache-free numpy reference picks from the model's logits, batched or solo, with no compiles after
warm-up, whatever the penalty values or whether a step asks for logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlora.engine.request import GenerationRequest, SamplingParams
from jaxlora.lora.bank import init_bank, set_slot, slot_arrays
from jaxlora.model import init_kv_cache
from tests.engine.conftest import engine_config
from tests.engine.test_engine import traffic

PROMPT = [1, 9, 10, 11, 9, 10]


def reference_penalised(parts, request: GenerationRequest) -> list[int]:
    """Greedy tokens with the penalties of `request`, by recomputing the whole sequence's logits each
    step and penalising them in numpy from the prompt and outputs so far (vLLM's formulas)."""
    model, tok, adapters = parts
    lora = engine_config().lora
    bank, slot = init_bank(model.config, lora), 0
    if request.adapter:
        bank, slot = set_slot(bank, 1, slot_arrays(adapters[request.adapter].weights, model.config, lora)), 1
    T, s = 64, request.sampling

    @jax.jit
    def logits_at(params, bank, tokens, length, slot):
        mod = nnx.merge(model.graphdef, params)
        hidden, _ = mod(
            tokens[None], jnp.arange(T)[None], init_kv_cache(model.config, 1, T), bank=bank, slot_ids=slot[None]
        )
        return mod.logits(hidden[0, length - 1])

    ids, out = list(request.prompt_ids), []
    for _ in range(s.max_tokens):
        padded = np.zeros(T, np.int32)
        padded[: len(ids)] = ids
        x = np.asarray(logits_at(model.params, bank, padded, np.int32(len(ids)), np.int32(slot)), np.float64)
        for t in set(ids):  # prompt and outputs
            x[t] = x[t] / s.repetition_penalty if x[t] > 0 else x[t] * s.repetition_penalty
        for t in set(out):
            x[t] -= s.frequency_penalty * out.count(t) + s.presence_penalty
        t = int(np.argmax(x))
        out.append(t)
        if t in tok.eos_token_ids:
            break
        ids.append(t)
    return out


def _request(name: str, **sampling) -> GenerationRequest:
    return GenerationRequest(request_id=name, prompt_ids=PROMPT, sampling=SamplingParams(max_tokens=14, **sampling))


@pytest.mark.parametrize(
    "penalties",
    [dict(repetition_penalty=2.0), dict(frequency_penalty=1.5, presence_penalty=0.5), dict(repetition_penalty=0.8)],
)
def test_penalised_greedy_tokens_equal_the_reference_batched_and_solo(engine, parts, penalties):
    engine.run_until_idle()
    plain = engine.generate([_request("plain")])[0]
    assert len(set(plain.token_ids)) < len(plain.token_ids), "the greedy run must repeat: pick another prompt"
    penalised = _request("pen", **penalties)
    others = traffic(6, seed=3)
    with jax.no_tracing():
        batched = engine.generate([*others[:3], penalised, *others[3:]])
        solo = engine.generate([penalised])[0]
    assert engine.compiles_after_warmup == 0
    assert list(solo.token_ids) == reference_penalised(parts, penalised)
    assert batched[3].token_ids == solo.token_ids
    assert solo.token_ids != plain.token_ids
    for o, r in zip(batched[:3] + batched[4:], others):  # rows beside it keep their own tokens
        assert o.token_ids == engine.generate([r])[0].token_ids, r.request_id


def test_a_row_reused_after_a_penalised_request_starts_with_an_empty_history(engine):
    """Two penalised requests, one after the other, on the same rows: the second equals its solo run
    on a fresh row, so nothing of the first's history leaks."""
    engine.run_until_idle()
    first = _request("first", frequency_penalty=2.0)
    second = GenerationRequest(
        request_id="second", prompt_ids=[1, 30, 31, 30], sampling=SamplingParams(max_tokens=10, frequency_penalty=2.0)
    )
    alone = engine.generate([second])[0]
    engine.generate([first])
    assert engine.generate([second])[0].token_ids == alone.token_ids


def test_logprobs_of_greedy_tokens_are_the_top_ones_and_toggling_them_compiles_nothing(engine):
    engine.run_until_idle()
    with jax.no_tracing():
        plain, lp, sampled = engine.generate(
            [
                _request("no-lp"),
                _request("lp", logprobs=5),
                _request("lp-hot", logprobs=20, temperature=1.0, seed=3),
            ]
        )
    assert engine.compiles_after_warmup == 0
    assert plain.logprobs is None
    assert lp.token_ids == plain.token_ids and len(lp.logprobs) == len(lp.token_ids)
    for token, entry in zip(lp.token_ids, lp.logprobs):
        assert entry.token_id == token and len(entry.top) == 5
        assert entry.top[0][0] == token and entry.logprob == pytest.approx(entry.top[0][1])
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True) and sum(np.exp(values)) <= 1 + 1e-5
    assert len(sampled.logprobs) == len(sampled.token_ids)
    for entry in sampled.logprobs:
        assert len(entry.top) == 20 and entry.logprob <= entry.top[0][1] + 1e-6
        assert sum(np.exp([v for _, v in entry.top])) <= 1 + 1e-5


def test_streamed_updates_carry_one_logprob_per_token(engine):
    engine.run_until_idle()
    handle = engine.submit(_request("stream-lp", logprobs=2), stream=True)
    engine.run_until_idle()
    updates = list(handle)
    assert all(len(u.logprobs) == len(u.token_ids) for u in updates if u.token_ids)
    streamed = [e for u in updates for e in (u.logprobs or ())]
    assert tuple(streamed) == handle.result(0).logprobs


def test_only_steps_with_a_penalised_or_logprobs_row_run_the_extended_sampler(engine, monkeypatch):
    """A plain greedy request never reaches the sampler; a penalised greedy one, and one asking for
    logprobs, run its extended variant once per token; neither compiles anything."""
    import jaxlora.engine.runner as runner_module

    calls: list[bool] = []
    fn = runner_module.packed_sample
    monkeypatch.setattr(runner_module, "packed_sample", lambda *a, **k: calls.append(k["extended"]) or fn(*a, **k))
    engine.run_until_idle()
    with jax.no_tracing():
        engine.generate([_request("plain-fast")])
        assert calls == []
        penalised = engine.generate([_request("pen-fast", presence_penalty=0.5)])[0]
        assert calls == [True] * len(penalised.token_ids)
        calls.clear()
        asked = engine.generate([_request("lp-fast", logprobs=1)])[0]
    assert calls == [True] * len(asked.token_ids) and engine.compiles_after_warmup == 0
