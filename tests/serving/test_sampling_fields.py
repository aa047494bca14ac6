"""Penalties and logprobs through both front doors, on the tiny engine: HTTP (chat and completions,
streamed and whole, through the `openai` client) and gRPC (`InferenceClient`) accept the fields, they
change what comes back, and the logprobs come in each API's own shape. Nothing compiles after
warm-up."""

from __future__ import annotations

import math
from collections.abc import Iterator

import openai
import pytest

from serving.server import InferenceServer
from tests.serving.support import connect, running_server

PROMPT = "abcabcabc"
CHAT = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def live(engine, adapter_root) -> Iterator[InferenceServer]:
    with running_server(engine, http_port=0, adapter_roots=(str(adapter_root),)) as server:
        yield server


@pytest.fixture(scope="module")
def http(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{live.http_port}/v1", api_key="x", max_retries=0, timeout=120)


def _completion(http: openai.OpenAI, **kw) -> openai.types.Completion:
    return http.completions.create(model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, **kw)


def test_repetition_penalty_changes_a_repeating_greedy_continuation(http, live, engine):
    plain = _completion(http, logprobs=0)
    tokens = plain.choices[0].logprobs.tokens
    assert len(set(tokens)) < len(tokens), "the greedy continuation must repeat: pick another prompt"
    penalised = _completion(http, extra_body={"repetition_penalty": 2.0})
    assert penalised.choices[0].text != plain.choices[0].text
    frequency = _completion(http, frequency_penalty=2.0, presence_penalty=1.0)
    assert frequency.choices[0].text != plain.choices[0].text
    with connect(live) as grpc_client:
        same = grpc_client.generate(PROMPT, adapter="alpha", max_tokens=12, temperature=0, repetition_penalty=2.0)
        neutral = grpc_client.generate(PROMPT, adapter="alpha", max_tokens=12, temperature=0, frequency_penalty=0.0)
    assert same.text == penalised.choices[0].text
    assert neutral.text == plain.choices[0].text
    assert engine.compiles_after_warmup == 0


def test_completions_logprobs_have_the_legacy_shape(http):
    out = _completion(http, logprobs=3)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and logprob == max(top.values())  # greedy: the chosen token is the likeliest
        assert 3 <= len(top) <= 4 and sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
    assert "".join(lp.tokens) == out.choices[0].text
    streamed = http.completions.create(
        model="alpha", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3, stream=True
    )
    chunks = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_openai_s_shape(http, stream):
    kw = dict(model="alpha", messages=CHAT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=4)
    if stream:
        chunks = list(http.chat.completions.create(**kw, stream=True))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = http.chat.completions.create(**kw)
        content, text = out.choices[0].logprobs.content, out.choices[0].message.content
    assert len(content) == 8 and "".join(e.token for e in content) == text
    for e in content:
        assert len(e.top_logprobs) == 4 and e.logprob == e.top_logprobs[0].logprob
        assert bytes(e.bytes).decode() == e.token
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-5
    whole = http.chat.completions.create(model="alpha", messages=CHAT, max_tokens=8, temperature=0)
    assert whole.choices[0].logprobs is None and whole.choices[0].message.content == text


def test_grpc_logprobs_and_bad_values(live):
    with connect(live) as client:
        out = client.generate(PROMPT, adapter="alpha", max_tokens=6, temperature=0, logprobs=2)
        assert len(out.logprobs) == len(out.token_ids) == 6
        for token, e in zip(out.token_ids, out.logprobs):
            assert e.token_id == token and len(e.top_logprobs) == 2
            assert e.top_logprobs[0].token_id == token and e.logprob == pytest.approx(e.top_logprobs[0].logprob)
        assert client.generate(PROMPT, adapter="alpha", max_tokens=3).logprobs == ()
        for bad in (dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(logprobs=21)):
            with pytest.raises(Exception, match=next(iter(bad))):
                client.generate(PROMPT, max_tokens=3, **bad)


def test_http_refuses_out_of_range_values_naming_the_field(http):
    for kw, param in [
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(logprobs=6), "logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            _completion(http, **kw)
        assert e.value.body["param"] == param
