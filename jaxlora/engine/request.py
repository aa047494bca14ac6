"""What a caller asks for (`GenerationRequest`, `SamplingParams`), what it gets back (`RequestOutput`),
and the engine's mutable state of one request while it runs (`Request`)."""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any

from jaxlora.errors import RequestError

Messages = Sequence[dict[str, str]]


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ERROR = "error"
    CANCELLED = "cancelled"


class Phase(enum.Enum):
    WAITING = "waiting"  # queued (or preempted): no row, no KV pages
    PREFILL = "prefill"  # has a row and a slot; prompt chunks still to run
    DECODE = "decode"  # one token per step
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off.

    max_tokens None takes OpenAI's default for the request's kind (`default_max_tokens`): 16 for a
    prompt to complete, the rest of the context for a chat. A request with a seed gets the same tokens
    whatever else shares its batch. vLLM's extra fields: `min_p` (0: off) drops tokens less likely
    than min_p times the most likely one; EOS and `stop_token_ids` end nothing before `min_tokens`
    tokens (EOS is not sampled then; stop strings still apply); `ignore_eos` generates on past EOS.

    Penalties (`jaxlora.engine.sampling.apply_penalties`): `repetition_penalty` (vLLM's, > 0, 1: off)
    over the prompt and the output so far; `presence_penalty` and `frequency_penalty` (OpenAI's,
    in [-2, 2], 0: off) over the output so far. `logprobs` (None: off) asks for each generated
    token's log-probability and those of the `logprobs` most likely tokens (0 to TOP_LOGPROBS), from
    the model's raw distribution (before penalties and temperature).
    """

    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise RequestError(f"max_tokens={self.max_tokens} must be >= 1")
        _check_number("temperature", self.temperature)
        if not self.temperature >= 0:
            raise RequestError(f"temperature={self.temperature} must be >= 0")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p={self.top_p} must be in (0, 1]")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise RequestError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.seed is not None:
            _check_int("seed", self.seed)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p={self.min_p} must be in [0, 1]")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise RequestError(f"min_tokens={self.min_tokens} must be in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos={self.ignore_eos!r} must be a boolean")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise RequestError(f"repetition_penalty={self.repetition_penalty} must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= TOP_LOGPROBS:
                raise RequestError(f"logprobs={self.logprobs} must be in [0, {TOP_LOGPROBS}] (alternatives per token)")

    def check_limits(self, *, max_new_tokens_limit: int, vocab_size: int) -> None:
        if self.max_tokens is not None and self.max_tokens > max_new_tokens_limit:
            raise RequestError(f"max_tokens={self.max_tokens} exceeds the engine limit {max_new_tokens_limit}")
        if self.top_k > vocab_size:
            raise RequestError(f"top_k={self.top_k} exceeds the vocabulary size {vocab_size}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


# The temperature of a request that gives none, on every surface a user reaches (HTTP, gRPC, batch
# lines, the generate command): OpenAI's and vLLM's default. A request without a seed then gets one:
# the engine draws it from its --seed, and a batch job derives it from the job's seed and the line
# (`jaxlora.engine.batch_job.line_seed`), so a resumed job gives the same tokens. `SamplingParams`
# built in Python stays greedy unless told otherwise: library code and tests choose explicitly.
DEFAULT_TEMPERATURE = 1.0
TOP_LOGPROBS = 20  # the most alternatives per token (OpenAI's top_logprobs limit; the sampler's K)
COMPLETION_MAX_TOKENS = 16  # OpenAI's completions API default


def default_max_tokens(*, is_chat: bool, num_prompt: int, max_seq_len: int, max_new_tokens_limit: int) -> int:
    """max_tokens for a request that gives none, as OpenAI's APIs: a completion gets 16 tokens, a chat
    the rest of the context; both within the engine's limit and the room the prompt leaves (which
    may be 0: the caller refuses such a prompt)."""
    room = min(max_seq_len - num_prompt, max_new_tokens_limit)
    return room if is_chat else min(COMPLETION_MAX_TOKENS, room)


def _check_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name}={value!r} must be an integer")


# The sampler computes in float32: a larger finite value (1e39, a JSON double) would arrive as inf,
# and inf * a logit of 0 is NaN, which argmax picks.
_FLOAT32_MAX = 3.4028234663852886e38


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name}={value!r} must be a number")
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise RequestError(f"{name}={value!r} must be a finite number within float32's range")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt: exactly one of `prompt` (text), `messages` (chat) or `prompt_ids` (token ids).

    adapter: registered adapter name; None or "" for the base model.
    """

    request_id: str
    prompt: str | None = None
    messages: Messages | None = None
    prompt_ids: Sequence[int] | None = None
    adapter: str | None = None
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise RequestError(f"request_id={self.request_id!r} must be a non-empty string")
        given = [k for k in ("prompt", "messages", "prompt_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise RequestError(
                f"request {self.request_id}: give exactly one of prompt, messages, prompt_ids (got {given or 'none'})"
            )
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise RequestError(f"request {self.request_id}: prompt must be a string")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise RequestError(f"request {self.request_id}: adapter={self.adapter!r} must be a string")
        if not isinstance(self.sampling, SamplingParams):
            raise RequestError(f"request {self.request_id}: sampling must be SamplingParams")


class TokenLogprob(typing.NamedTuple):
    """A generated token's log-probability and the `SamplingParams.logprobs` most likely tokens'
    (token id, log-probability), most likely first; all of the model's raw distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestOutput(typing.NamedTuple):
    """One streamed update. `text` and `token_ids` are deltas since the previous update; the final
    update (finished=True) carries `finish_reason` and, for errors, `error`. `logprobs`: one entry per
    token of `token_ids`, for a request that asks for them (`SamplingParams.logprobs`), else None.

    Immutable like the dataclasses here, but a NamedTuple: the engine builds one per generated token
    on its loop thread, and a frozen dataclass costs several times more to build. Build it with
    keywords.
    """

    request_id: str
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


def token_output(
    request_id: str,
    text: str,
    token: int,
    prompt_tokens: int,
    completion_tokens: int,
    logprob: TokenLogprob | None = None,
) -> RequestOutput:
    """The per-token update of a running request: RequestOutput(request_id=..., text=text,
    token_ids=(token,), prompt_tokens=..., completion_tokens=..., logprobs=(logprob,) or None), every
    other field at its default.

    Built as the tuple it is, in field order, because the NamedTuple's generated __new__ with keywords
    costs several times more and the engine builds one per generated token. The one place that
    relies on the field order; tests/engine/test_request_output.py checks it against keywords."""
    logprobs = None if logprob is None else (logprob,)
    return _new_tuple(
        RequestOutput, (request_id, text, (token,), False, None, prompt_tokens, completion_tokens, None, logprobs)
    )


_new_tuple = tuple.__new__


@dataclasses.dataclass(frozen=True, kw_only=True)
class FinalOutput:
    """A finished request, accumulated: full text and every generated token id (and its logprobs, for a
    request that asks for them)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None


class Request:
    """Mutable engine-side state of one request (owned by the engine thread after submit).

    Positions: the prompt occupies [0, num_prompt); generated token i sits at num_prompt + i.
    `num_computed` positions have their keys and values in the request's KV pages. A preempted
    request loses its pages and goes back to waiting; when admitted again it prefills every token it
    knows (prompt and the outputs read so far) and then decodes on, so its tokens equal a solo run.
    """

    def __init__(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        *,
        seed: int,
        arrival: int,
        callback: Callable[[RequestOutput], None] | None = None,
    ):
        self.request = request
        self.request_id = request.request_id
        self.adapter = request.adapter or None
        self.sampling = request.sampling
        self.prompt_ids = prompt_ids
        self.seed = seed
        self.arrival = arrival  # submit order: the scheduler's first-come key
        self.callback = callback
        self.phase = Phase.WAITING
        self.row: int | None = None
        self.slot: int | None = None
        self.has_pin = False  # holds one pager acquire of its adapter (released at finish)
        self.weights_identity: bytes | None = None  # its adapter's, read when pinned (prefix caching)
        self.num_computed = 0
        self.num_preemptions = 0
        # Prefix caching (`jaxlora.engine.scheduler`): positions its latest admission took from the
        # cache (its first chunk starts there), the keys of its full pages so far (each hashed once),
        # and how many of the pages on its row are keyed in the page table.
        self.num_cached = 0
        self.page_keys: list[bytes] = []
        self.num_keyed = 0
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if request.sampling.logprobs is None else []
        # Tokens sampled by dispatched steps whose ids the host has not read yet (0, 1, or 2 for the
        # moment between dispatching step N+1 and reading step N), and where the newest one is in the
        # runner's last outputs (see jaxlora.engine.runner).
        self.num_pending = 0
        self.pending_src = -1
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def num_dispatched(self) -> int:
        """Output tokens read plus those still in flight."""
        return self.num_output + self.num_pending

    @property
    def num_known(self) -> int:
        """Tokens the host holds: the prompt and the outputs read so far."""
        return self.num_prompt + self.num_output

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids of positions [start, stop) (prompt, then read outputs)."""
        prompt = self.prompt_ids[start:stop]
        if stop <= self.num_prompt:
            return prompt
        return prompt + self.output_ids[max(0, start - self.num_prompt) : stop - self.num_prompt]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def next_position(self) -> int:
        """Position of the token fed to the next decode step (the last sampled one, read or not)."""
        return self.num_prompt + self.num_dispatched - 1

    @property
    def is_finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.phase.value}, row={self.row}, slot={self.slot})"
