"""The pieces both front doors share, without a server: the status table, the translation from API
fields to a GenerationRequest, the final-update check, and the OpenAI request reader."""

from __future__ import annotations

import grpc
import pytest

from jaxlora.engine.request import (
    DEFAULT_TEMPERATURE,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from jaxlora.errors import (
    AdapterError,
    AdapterInUseError,
    CapacityError,
    JaxloraError,
    RequestError,
    UnknownAdapterError,
)
from serving.api import ApiError, Limits, Status, error_of, final_error, generation_request
from serving.openai_api import (
    TextOffsets,
    chat_logprobs,
    chunk,
    completion_logprobs,
    error_body,
    parse_request,
)
from serving.security import PathRefused

LIMITS = Limits(max_new_tokens=64, vocab_size=100)


@pytest.mark.parametrize(
    "error, status, http",
    [
        (UnknownAdapterError("adapter 'x' is not registered"), Status.NOT_FOUND, 404),
        (PathRefused("outside every adapter root"), Status.PERMISSION_DENIED, 403),
        (FileNotFoundError("no such folder"), Status.NOT_FOUND, 404),
        (RequestError("top_p=2 must be in (0, 1]"), Status.INVALID_ARGUMENT, 400),
        (AdapterError("rank 32 exceeds max_rank=16"), Status.INVALID_ARGUMENT, 400),
        (CapacityError("the admission queue is full"), Status.RESOURCE_EXHAUSTED, 429),
        (AdapterInUseError("still used"), Status.FAILED_PRECONDITION, 409),
        (JaxloraError("no pager"), Status.FAILED_PRECONDITION, 409),
        (ZeroDivisionError("a bug"), Status.INTERNAL, 500),
    ],
)
def test_one_table_for_grpc_and_http(error, status, http):
    api_error = error_of(error)
    assert api_error.status is status and status.http_status == http
    assert status.grpc_code is grpc.StatusCode[status.name] and Status.of_grpc(status.grpc_code) is status
    if status is Status.INTERNAL:
        assert "a bug" not in api_error.message  # no internals leak to clients
    else:
        assert api_error.message == str(error)


def test_a_full_engine_while_draining_is_unavailable_not_retry_here():
    assert error_of(CapacityError("the engine is stopping"), is_draining=True).status is Status.UNAVAILABLE


def test_every_status_has_an_http_row_and_a_grpc_code():
    for status in Status:
        assert 400 <= status.http_status < 600 and status.error_type.endswith("_error")
        assert status.grpc_code.name == status.name


@pytest.mark.parametrize(
    "sampling, param",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 3, "top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"top_k": 101}, "top_k"),  # above the vocabulary
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 65}, "max_tokens"),  # above the engine limit
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (100,)}, "stop_token_ids"),  # outside the vocabulary
        ({"seed": 1.5}, "seed"),
    ],
)
def test_translation_names_the_field_at_fault(sampling, param):
    with pytest.raises(ApiError) as e:
        generation_request(request_id="r", adapter=None, sampling=sampling, limits=LIMITS, prompt="hi")
    assert e.value.status is Status.INVALID_ARGUMENT and e.value.param == param and param in e.value.message


def test_translation_builds_the_engine_request():
    gen = generation_request(
        request_id="r",
        adapter="",
        limits=LIMITS,
        messages=[{"role": "user", "content": "hi"}],
        sampling={"max_tokens": 5, "temperature": 0.5, "stop": ("x",), "top_k": 3},
    )
    assert gen.adapter is None and gen.messages[0]["content"] == "hi"
    s = gen.sampling
    assert (s.max_tokens, s.temperature, s.stop, s.top_k, s.top_p) == (5, 0.5, ("x",), 3, 1.0)
    with pytest.raises(ApiError, match="exactly one of prompt"):
        generation_request(request_id="r", adapter=None, sampling={}, limits=LIMITS)
    # Every API's one default: OpenAI's temperature 1, whichever front door (HTTP, gRPC) sent it.
    plain = generation_request(request_id="r", adapter=None, sampling={}, limits=LIMITS, prompt="hi")
    assert plain.sampling.temperature == DEFAULT_TEMPERATURE == 1.0


def _final(reason: FinishReason, error: str | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", finished=True, finish_reason=reason, error=error)


def test_final_update_check():
    gen = GenerationRequest(request_id="r", prompt="hi", adapter="gone")
    known, unknown = (lambda name: True), (lambda name: False)
    assert final_error(_final(FinishReason.LENGTH), gen, has_adapter=known, client_gone=False) is None
    assert final_error(_final(FinishReason.STOP), gen, has_adapter=known, client_gone=False) is None
    shutdown = final_error(_final(FinishReason.CANCELLED), gen, has_adapter=known, client_gone=False)
    assert shutdown.status is Status.UNAVAILABLE
    assert (
        final_error(_final(FinishReason.CANCELLED), gen, has_adapter=known, client_gone=True).status is Status.CANCELLED
    )
    unloaded = final_error(_final(FinishReason.ERROR, "unknown adapter"), gen, has_adapter=unknown, client_gone=False)
    assert unloaded.status is Status.NOT_FOUND and "unloaded" in unloaded.message
    failed = final_error(_final(FinishReason.ERROR, "nan logits"), gen, has_adapter=known, client_gone=False)
    assert failed.status is Status.INTERNAL and failed.message == "nan logits"


def test_openai_fields_and_defaults():
    p = parse_request({"model": "base", "prompt": "hi"}, chat=False, base_model="base")
    assert p.adapter is None and p.prompt == "hi" and p.sampling == {}  # defaults: generation_request's
    assert not p.stream and not p.include_usage
    p = parse_request(
        {
            "model": "shout",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_k": -1,
            "stop": "\n",
            "seed": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "user": "x",
        },
        chat=True,
        base_model="base",
    )
    assert p.adapter == "shout" and p.messages == [{"role": "user", "content": "ab"}] and p.prompt_field == "messages"
    assert p.sampling == {"temperature": 0, "max_tokens": 7, "top_k": 0, "stop": ("\n",), "seed": 3}
    assert p.field_names == {"max_tokens": "max_completion_tokens"} and p.stream and p.include_usage
    assert parse_request({"prompt": [[1, 2, 3]]}, chat=False, base_model="base").prompt_ids == [1, 2, 3]
    assert parse_request({"prompt": ["one"]}, chat=False, base_model="base").prompt == "one"


@pytest.mark.parametrize(
    "body, chat, param",
    [
        ([], False, None),
        ({"prompt": "hi", "n": 2}, False, "n"),
        ({"prompt": "hi", "logit_bias": {"1": 5}}, False, "logit_bias"),
        ({"prompt": "hi", "model": 3}, False, "model"),
        ({}, False, "prompt"),
        ({"prompt": ["a", "b"]}, False, "prompt"),  # one prompt per request
        ({"prompt": "hi", "stop": 5}, False, "stop"),
        ({"prompt": "hi", "stream": "yes"}, False, "stream"),
        ({"prompt": "hi", "max_tokens": 3, "max_completion_tokens": 4}, False, "max_tokens"),
        ({"messages": []}, True, "messages"),
        ({"messages": [{"content": "no role"}]}, True, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages"),
        ({"prompt": "hi", "response_format": {"type": "json_object"}}, False, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "guided_json": {"type": "object"}}, True, "guided_json"),
        ({"prompt": "hi", "logprobs": 6}, False, "logprobs"),  # completions: at most 5
        ({"prompt": "hi", "logprobs": True}, False, "logprobs"),  # completions: a count
        ({"prompt": "hi", "top_logprobs": 2}, False, "top_logprobs"),  # chat's field
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, True, "logprobs"),  # chat: a boolean
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, "top_logprobs"),  # no logprobs
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
        ({"prompt": "hi", "adapter": "shout"}, False, "adapter"),
        ({"prompt": "hi", "max_token": 5}, False, "max_token"),
        ({"prompt": "hi", "messages": []}, False, "messages"),
    ],
)
def test_openai_request_errors_name_the_field(body, chat, param):
    with pytest.raises(ApiError) as e:
        parse_request(body, chat=chat, base_model="base")
    assert e.value.status is Status.INVALID_ARGUMENT and e.value.param == param
    assert error_body(e.value)["error"] == {
        "message": e.value.message,
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_argument",
    }


def test_unknown_fields_name_the_nearest_known_one_and_unbuilt_ones_say_so():
    with pytest.raises(ApiError, match="did you mean 'max_tokens'"):
        parse_request({"prompt": "hi", "max_token": 5}, chat=False, base_model="base")
    with pytest.raises(ApiError, match="JSON mode and structured outputs are not built"):
        parse_request({"prompt": "hi", "response_format": {"type": "json_object"}}, chat=False, base_model="base")
    neutral = {"response_format": {"type": "text"}, "echo": False, "user": "u", "n": 1}
    assert parse_request({"prompt": "hi", **neutral}, chat=False, base_model="base").prompt == "hi"


def test_vllm_extra_fields_reach_the_sampling_params():
    body = {"prompt": "hi", "min_p": 0.1, "min_tokens": 2, "ignore_eos": True, "max_tokens": 5}
    p = parse_request(body, chat=False, base_model="base")
    params = SamplingParams(**p.sampling)
    assert (params.min_p, params.min_tokens, params.ignore_eos, params.max_tokens) == (0.1, 2, True, 5)
    # max_tokens left to the engine (the rest of the context for a chat), the temperature to
    # generation_request (DEFAULT_TEMPERATURE, as on every surface).
    assert parse_request({"messages": [{"role": "user", "content": "x"}]}, chat=True, base_model="b").sampling == {}


def test_penalties_and_logprobs_reach_the_sampling_params():
    body = {"prompt": "hi", "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -1, "logprobs": 3}
    params = SamplingParams(**parse_request(body, chat=False, base_model="base").sampling)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.2, 0.5, -1)
    assert params.logprobs == 3
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert (
        parse_request({**chat, "logprobs": True, "top_logprobs": 7}, chat=True, base_model="b").sampling["logprobs"]
        == 7
    )
    assert parse_request({**chat, "logprobs": True}, chat=True, base_model="b").sampling["logprobs"] == 0
    assert "logprobs" not in parse_request({**chat, "logprobs": False}, chat=True, base_model="b").sampling
    for bad in (dict(repetition_penalty=0), dict(presence_penalty=2.5), dict(frequency_penalty=-3)):
        with pytest.raises(RequestError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_logprobs_objects_have_openai_shapes():
    entries = [TokenLogprob(5, -0.1, ((5, -0.1), (6, -2.5))), TokenLogprob(7, -3.0, ((6, -0.2), (8, -1.9)))]
    text = {5: "ab", 6: "c", 7: "é", 8: "d"}.__getitem__
    chat = chat_logprobs(entries, text)["content"]
    assert chat[1] == {
        "token": "é",
        "logprob": -3.0,
        "bytes": [0xC3, 0xA9],
        "top_logprobs": [
            {"token": "c", "logprob": -0.2, "bytes": [99]},
            {"token": "d", "logprob": -1.9, "bytes": [100]},
        ],
    }
    raw = {5: b"ab", 6: b"c", 7: b"\xc3", 8: b"d"}.__getitem__  # token 7: half of a character
    assert chat_logprobs(entries, text, raw)["content"][1]["bytes"] == [0xC3]
    legacy = completion_logprobs(entries, text, [4, 6])
    assert legacy == {
        "tokens": ["ab", "é"],
        "token_logprobs": [-0.1, -3.0],
        "top_logprobs": [{"ab": -0.1, "c": -2.5}, {"c": -0.2, "d": -1.9, "é": -3.0}],
        "text_offset": [4, 6],
    }


def test_text_offsets_count_a_split_character_once_across_chunks():
    raw = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"b", 5: b" \xf0\x9f", 6: b"\x99\x82", 7: b"!"}.__getitem__
    offsets = TextOffsets(raw)
    # "a", then "é" split over tokens 2 and 3, "b", then " 🙂" split over 5 and 6, "!"; two chunks.
    assert offsets.next([1, 2, 3]) + offsets.next([4, 5, 6, 7]) == [0, 1, 1, 2, 3, 4, 5]
    assert len("aéb 🙂") == 5


def test_stream_chunks_have_openai_shapes():
    kw = dict(request_id="c", created=1, model="m")
    first = chunk(**kw, chat=True, role=True, text="")
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    assert "usage" not in first
    last = chunk(**kw, chat=False, text="!", finish_reason="stop", include_usage=True)
    assert last["choices"][0] == {"index": 0, "text": "!", "logprobs": None, "finish_reason": "stop"}
    assert last["usage"] is None
    usage = chunk(
        **kw, chat=True, include_usage=True, usage_={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    )
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 3
