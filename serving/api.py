"""What the two front doors, gRPC (`serving.server`) and OpenAI-compatible HTTP (`serving.http_server`),
share: one status table, one translation from API fields to a `GenerationRequest`, and one check of a
request's final update. Neither server validates a field itself; both call these.

The status table: every outcome a caller can see is a `Status`, named after its gRPC code, with the
HTTP status and OpenAI error `type` the HTTP server answers with:

| Status | HTTP | when |
|---|---|---|
| INVALID_ARGUMENT | 400 | bad field (named in `param`), bad adapter file or name, prompt too long |
| UNAUTHENTICATED | 401 | missing or wrong key |
| PERMISSION_DENIED | 403 | admin call without the admin key; adapter path outside every root |
| NOT_FOUND | 404 | unknown model/adapter, adapter folder missing |
| ALREADY_EXISTS | 409 | loading a name that is taken |
| FAILED_PRECONDITION | 409 | unloading an adapter still in use after the timeout |
| RESOURCE_EXHAUSTED | 429 | admission queue or concurrent-stream limit full |
| CANCELLED | 499 | the client went away (nobody reads the answer) |
| INTERNAL | 500 | a bug; logged, the other requests go on |
| UNAVAILABLE | 503 | warming up, draining, or the engine stopped |
| DEADLINE_EXCEEDED | 504 | the caller's deadline passed |
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from jaxlora.engine.request import (
    DEFAULT_TEMPERATURE,
    FinishReason,
    GenerationRequest,
    Messages,
    RequestOutput,
    SamplingParams,
)
from jaxlora.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterInUseError,
    CapacityError,
    EngineFailedError,
    JaxloraError,
    RequestError,
    UnknownAdapterError,
)
from serving.security import PathRefused

if TYPE_CHECKING:
    from jaxlora.engine.engine import Engine


class Status(enum.Enum):
    """An outcome of a call; the name is its gRPC status code."""

    INVALID_ARGUMENT = enum.auto()
    UNAUTHENTICATED = enum.auto()
    PERMISSION_DENIED = enum.auto()
    NOT_FOUND = enum.auto()
    ALREADY_EXISTS = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    CANCELLED = enum.auto()
    INTERNAL = enum.auto()
    UNAVAILABLE = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.name]

    @property
    def http_status(self) -> int:
        return _HTTP[self][0]

    @property
    def error_type(self) -> str:
        """The OpenAI error object's `type`."""
        return _HTTP[self][1]

    @classmethod
    def of_grpc(cls, code: grpc.StatusCode) -> Status:
        return cls[code.name]


_HTTP: dict[Status, tuple[int, str]] = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Status.UNAUTHENTICATED: (401, "authentication_error"),
    Status.PERMISSION_DENIED: (403, "permission_error"),
    Status.NOT_FOUND: (404, "not_found_error"),
    Status.ALREADY_EXISTS: (409, "conflict_error"),
    Status.FAILED_PRECONDITION: (409, "conflict_error"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Status.CANCELLED: (499, "cancelled_error"),  # nginx's "client closed request"
    Status.INTERNAL: (500, "server_error"),
    Status.UNAVAILABLE: (503, "service_unavailable_error"),
    Status.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class ApiError(Exception):
    """Ends a call with `status`; `param` names the request field at fault, if one is; `http_status`
    overrides the status table's HTTP status where HTTP has a more precise one (413 for a body too
    large, which gRPC answers RESOURCE_EXHAUSTED)."""

    def __init__(
        self, status: Status, message: str, *, param: str | None = None, http_status: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.http_status = http_status or status.http_status


def error_of(error: Exception, *, is_draining: bool = False) -> ApiError:
    """The ApiError a library error means for the caller (`is_draining`: the server is shutting down,
    so a full engine is not a reason to retry here)."""
    match error:
        case ApiError():
            return error
        case UnknownAdapterError():
            return ApiError(Status.NOT_FOUND, str(error))
        case AdapterExistsError():  # a concurrent load of the same name won the registry's reservation
            return ApiError(Status.ALREADY_EXISTS, str(error))
        case PathRefused():
            return ApiError(Status.PERMISSION_DENIED, str(error))
        case FileNotFoundError():
            return ApiError(Status.NOT_FOUND, str(error))
        case RequestError() | AdapterError():
            return ApiError(Status.INVALID_ARGUMENT, str(error))
        case EngineFailedError():
            return ApiError(Status.UNAVAILABLE, str(error))
        case CapacityError() if is_draining:
            return ApiError(Status.UNAVAILABLE, "the server is shutting down")
        case CapacityError():
            return ApiError(Status.RESOURCE_EXHAUSTED, str(error))
        case AdapterInUseError() | JaxloraError():
            return ApiError(Status.FAILED_PRECONDITION, str(error))
    return ApiError(Status.INTERNAL, f"internal error: {type(error).__name__}")  # details stay in the log


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """The engine limits a request's sampling fields are checked against before it is queued."""

    max_new_tokens: int
    vocab_size: int

    @classmethod
    def of(cls, engine: Engine) -> Limits:
        return cls(max_new_tokens=engine.config.max_new_tokens_limit, vocab_size=engine.model.config.vocab_size)


def generation_request(
    *,
    request_id: str,
    adapter: str | None,
    sampling: Mapping[str, Any],
    limits: Limits,
    prompt: str | None = None,
    messages: Messages | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> GenerationRequest:
    """The engine request for one API call. The prompt itself (empty, too long for `max_seq_len`,
    token ids outside the vocabulary) is checked by `Engine.submit`.

    Args:
      adapter: the adapter name; None or "" for the base model.
      sampling: the `SamplingParams` fields the caller set; the others take its defaults, but for
        the temperature: DEFAULT_TEMPERATURE, the one default of every API.
      limits: the engine's limits (max_tokens, top_k and stop_token_ids are checked against them).

    Raises:
      ApiError: INVALID_ARGUMENT, with `param` set to the sampling field at fault.
    """
    try:
        params = SamplingParams(**{"temperature": DEFAULT_TEMPERATURE, **sampling})
        params.check_limits(max_new_tokens_limit=limits.max_new_tokens, vocab_size=limits.vocab_size)
    except RequestError as e:
        raise ApiError(Status.INVALID_ARGUMENT, str(e), param=_field_at_fault(sampling, limits)) from None
    try:
        return GenerationRequest(
            request_id=request_id,
            prompt=prompt,
            messages=messages,
            prompt_ids=prompt_ids,
            adapter=adapter or None,
            sampling=params,
        )
    except RequestError as e:
        raise ApiError(Status.INVALID_ARGUMENT, str(e)) from None


def _field_at_fault(sampling: Mapping[str, Any], limits: Limits) -> str | None:
    """The first field that SamplingParams refuses on its own (max_tokens=1 stands in for the others)."""
    for name, value in sampling.items():
        try:
            SamplingParams(**{"max_tokens": 1, name: value}).check_limits(
                max_new_tokens_limit=limits.max_new_tokens, vocab_size=limits.vocab_size
            )
        except RequestError:
            return name
    return None


def final_error(
    out: RequestOutput, gen: GenerationRequest, *, has_adapter: Callable[[str], bool], client_gone: bool
) -> ApiError | None:
    """None if the request's final update `out` ended it normally (STOP or LENGTH), else the error
    the caller gets.

    Args:
      has_adapter: whether an adapter is still registered (an ERROR for an adapter unloaded between
        submit and admission is the caller's NOT_FOUND, not a server fault).
      client_gone: the caller disconnected (a CANCELLED request was its own doing).
    """
    if out.finish_reason is FinishReason.CANCELLED:
        if client_gone:
            return ApiError(Status.CANCELLED, "cancelled by the client")
        return ApiError(Status.UNAVAILABLE, "the server cancelled the request while shutting down")
    if out.finish_reason is FinishReason.ERROR:
        if gen.adapter and not has_adapter(gen.adapter):
            return ApiError(
                Status.NOT_FOUND,
                f"adapter {gen.adapter!r} was unloaded before the request started ({out.error})",
                param="model",
            )
        return ApiError(Status.INTERNAL, out.error or "the request failed")
    return None
