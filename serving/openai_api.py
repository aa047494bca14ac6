"""The OpenAI API's wire format: the body of a `/v1/completions` or `/v1/chat/completions` request,
read into the arguments of `serving.api.generation_request`, and engine outputs written as OpenAI
response objects and stream chunks.

Fields follow OpenAI's API reference, defaults included: `temperature` 1, `top_p` 1, and
`max_tokens` 16 for completions and the rest of the context for chat completions
(jaxlora.engine.request.default_max_tokens). `presence_penalty` and `frequency_penalty` are OpenAI's
(0: off); `logprobs` is a boolean with `top_logprobs` (0 to 20) in chat, and an integer (0 to 5) in
completions, as in OpenAI's two APIs, answered in each API's own shape (`chat_logprobs`,
`completion_logprobs`) with the raw distribution's log-probabilities. `top_k` (-1 or 0: off),
`stop_token_ids`, `min_p`, `min_tokens`, `ignore_eos` and `repetition_penalty` (1: off) are vLLM's
extra fields (what the `openai` client sends through `extra_body`). `model` names an adapter, or the
base model for none.

Nothing is ignored: a field OpenAI or vLLM defines that this server does not implement (JSON mode,
guided decoding, n > 1, ...) is refused unless it holds the value that leaves it off, and any other
field is refused as unknown, with the nearest known name.
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxlora.engine.request import TOP_LOGPROBS, TokenLogprob
from jaxlora.fields import first_unknown
from serving.api import ApiError, Status

# The fields read: OpenAI's, then vLLM's extra ones this server implements. `user` only names the
# caller, so any value is neutral.
_COMMON = frozenset(
    {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream"}
    | {"stream_options", "user", "top_k", "stop_token_ids", "min_p", "min_tokens", "ignore_eos"}
    | {"repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs"}
)
_KNOWN = {True: _COMMON | {"messages", "top_logprobs"}, False: _COMMON | {"prompt"}}
# The fields that are SamplingParams fields of the same name.
_EXTRA_SAMPLING = ("top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "presence_penalty")
_EXTRA_SAMPLING += ("frequency_penalty",)
COMPLETION_MAX_LOGPROBS = 5  # OpenAI's completions API limit

# Defined by OpenAI or vLLM but not implemented: the values that leave them off are accepted, any
# other is refused.
_NEUTRAL = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "length_penalty": (None, 1),
    "use_beam_search": (None, False),
    "skip_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False),
    "add_generation_prompt": (None, True),
    **{name: (None,) for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    **{name: (None,) for name in ("guided_decoding_backend", "structured_outputs", "prediction", "audio")},
}
_UNBUILT = {
    "response_format": "JSON mode and structured outputs are not built",
    "structured_outputs": "guided decoding is not built",
    **{name: "guided decoding is not built" for name in ("guided_json", "guided_regex", "guided_choice")},
    "guided_grammar": "guided decoding is not built",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedRequest:
    """One completions or chat request, read and type-checked (values are checked by SamplingParams).

    Attributes:
      model: the `model` field as given (echoed in responses).
      adapter: the adapter it names; None for the base model.
      prompt, prompt_ids, messages: exactly one is set (prompt_ids: a completions prompt of token ids).
      sampling: SamplingParams fields.
      field_names: sampling field -> the request field it came from, where they differ
        (`max_completion_tokens`), so errors name what the client sent.
      stream, include_usage: SSE streaming; a final usage chunk (`stream_options.include_usage`).
    """

    model: str
    adapter: str | None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    sampling: dict[str, Any]
    field_names: dict[str, str]
    stream: bool
    include_usage: bool

    @property
    def prompt_field(self) -> str:
        return "messages" if self.messages is not None else "prompt"


def parse_request(body: Any, *, chat: bool, base_model: str) -> ParsedRequest:
    """Reads a request body (decoded JSON).

    Raises:
      ApiError: INVALID_ARGUMENT naming the field (`param`).
    """
    if not isinstance(body, dict):
        raise _invalid("the request body must be a JSON object")
    _refuse_what_is_not_done(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _invalid(f"model={model!r} must be a string", "model")
    model = model or base_model
    sampling, field_names = _sampling(body)
    sampling.update(_chat_logprobs_field(body) if chat else _completion_logprobs_field(body))
    prompt = _messages(body) if chat else _prompt(body)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _invalid(f"stream={stream!r} must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _invalid('stream_options must be an object like {"include_usage": true}', "stream_options")
    return ParsedRequest(
        model=model,
        adapter=None if model == base_model else model,
        **prompt,
        sampling=sampling,
        field_names=field_names,
        stream=stream,
        include_usage=options.get("include_usage", False),
    )


def _refuse_what_is_not_done(body: dict, chat: bool) -> None:
    """ApiError for a field not implemented (unless neutral) or unknown; `param` names it."""
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            why = _UNBUILT.get(name, "not implemented")
            raise _invalid(f"{name}={body[name]!r} is not supported ({why}; leave it unset)", name)
    unknown = first_unknown(body, _KNOWN[chat] | _NEUTRAL.keys())
    if unknown is not None:
        raise _invalid(unknown[1], unknown[0])


def _sampling(body: dict) -> tuple[dict[str, Any], dict[str, str]]:
    sampling: dict[str, Any] = {}  # the others take serving.api.generation_request's defaults
    field_names: dict[str, str] = {}
    given = [f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None]
    if len(given) == 2 and body[given[0]] != body[given[1]]:
        raise _invalid("give max_completion_tokens or max_tokens, not both", "max_tokens")
    if given:
        sampling["max_tokens"] = body[given[0]]
        field_names["max_tokens"] = given[0]
    for name in ("temperature", "top_p", "seed", *_EXTRA_SAMPLING):
        if body.get(name) is not None:
            sampling[name] = body[name]
    if sampling.get("top_k") == -1:  # vLLM's clients send -1 for "off"
        sampling["top_k"] = 0
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, (str, list)):
            raise _invalid(f"stop={stop!r} must be a string or a list of strings", "stop")
        sampling["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise _invalid(f"stop_token_ids={stop_ids!r} must be a list of token ids", "stop_token_ids")
        sampling["stop_token_ids"] = tuple(stop_ids)
    return sampling, field_names


def _chat_logprobs_field(body: dict) -> dict[str, Any]:
    """Chat's `logprobs` (boolean) and `top_logprobs` (0 to 20, needs logprobs) -> SamplingParams'."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _invalid(f"logprobs={wanted!r} must be a boolean (top_logprobs sets how many alternatives)", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= TOP_LOGPROBS:
            raise _invalid(f"top_logprobs={top!r} must be an integer in [0, {TOP_LOGPROBS}]", "top_logprobs")
        if not wanted:
            raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return {"logprobs": top or 0} if wanted else {}


def _completion_logprobs_field(body: dict) -> dict[str, Any]:
    """Completions' `logprobs` (an integer, 0 to 5 alternatives) -> SamplingParams'."""
    n = body.get("logprobs")
    if n is None:
        return {}
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= COMPLETION_MAX_LOGPROBS:
        raise _invalid(f"logprobs={n!r} must be an integer in [0, {COMPLETION_MAX_LOGPROBS}]", "logprobs")
    return {"logprobs": n}


def _prompt(body: dict) -> dict[str, Any]:
    """A completions `prompt`: a string or a list of token ids (or a list holding one of those)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_ids": prompt}
    if prompt is None:
        raise _invalid("prompt is required", "prompt")
    raise _invalid("prompt must be one string or one list of token ids (one prompt per request)", "prompt")


def _messages(body: dict) -> dict[str, Any]:
    """Chat `messages` as the tokenizer's chat template takes them: role and text content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str):
            raise _invalid(f"messages[{i}] must be an object with a string role", "messages")
        out.append({"role": role, "content": _text_content(m.get("content"), i)})
    return {"messages": out}


def _text_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise _invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(Status.INVALID_ARGUMENT, message, param=param)


# Responses.
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(
    entries: Sequence[TokenLogprob],
    token_text: Callable[[int], str],
    token_bytes: Callable[[int], bytes] | None = None,
) -> dict[str, Any]:
    """Chat's `logprobs` object: per token its text, log-probability, bytes and alternatives.
    `token_bytes`: the raw bytes of a token (`Tokenizer.token_bytes`: part of a UTF-8 character
    for some tokens, whose text alone is U+FFFD); default, the UTF-8 of its text."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        raw = token_bytes(token_id) if token_bytes is not None else text.encode()
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    }


class TextOffsets:
    """Completions' `text_offset`: each token's character offset in the completion, counted from the
    tokens' raw bytes (`Tokenizer.token_bytes`), so a character split over two tokens counts once,
    at the token that completes it (the texts of such tokens alone are U+FFFD, one character each
    too many). One per completion: a stream's chunks continue from where the last one ended."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, token_ids: Sequence[int]) -> list[int]:
        """The offsets of the next tokens of the completion."""
        offsets = []
        for token_id in token_ids:
            offsets.append(self._chars)
            self._chars += len(self._decoder.decode(self._token_bytes(token_id)))
        return offsets


def completion_logprobs(
    entries: Sequence[TokenLogprob], token_text: Callable[[int], str], offsets: Sequence[int]
) -> dict[str, Any]:
    """Completions' legacy `logprobs` object: tokens, token_logprobs, top_logprobs (one dict of
    token text -> log-probability per token, the chosen token included, as vLLM sends them) and
    text_offset (`offsets`: each token's character offset in the completion, `TextOffsets`)."""
    texts = [token_text(e.token_id) for e in entries]
    return {
        "tokens": texts,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [
            {**{token_text(t): lp for t, lp in e.top}, text: e.logprob} for e, text in zip(entries, texts)
        ],
        "text_offset": list(offsets),
    }


def response(
    *,
    request_id: str,
    created: int,
    model: str,
    chat: bool,
    text: str,
    finish_reason: str,
    usage_: dict[str, int],
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion (`logprobs`: `chat_logprobs` or
    `completion_logprobs`, for a request that asked)."""
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
    }


def chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    chat: bool,
    text: str | None = None,
    finish_reason: str | None = None,
    role: bool = False,
    include_usage: bool = False,
    usage_: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stream chunk: a text delta (and `finish_reason` on the last one) with the logprobs of its
    tokens (for a request that asked), or with `usage_` the final usage chunk, which has no choices."""
    choices: list[dict[str, Any]] = []
    if usage_ is None:
        if chat:
            delta: dict[str, str] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    out = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if include_usage:
        out["usage"] = usage_  # null on every chunk but the last, as OpenAI sends them
    return out


def error_body(error: ApiError) -> dict[str, Any]:
    """The OpenAI error object."""
    return {
        "error": {
            "message": error.message,
            "type": error.status.error_type,
            "param": error.param,
            "code": error.status.name.lower(),
        }
    }
