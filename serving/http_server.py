"""The OpenAI-compatible HTTP front door: a Starlette app served by uvicorn on its own thread, over the
same engine, admission (phase, stream limit), adapter registry and metrics as the gRPC server.

    POST /v1/completions, /v1/chat/completions    `model` picks the adapter; `stream` for SSE
    GET  /v1/models                               the base model and every loaded adapter (`parent`)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter    vLLM's fields; admin key, --adapter-root
    GET  /health                                  200 while serving, 503 warming up or draining
    GET  /metrics                                 Prometheus (the same registry as --metrics-port)

Errors are OpenAI error objects with the HTTP status of the shared table (serving.api). A request
waits for the engine on the event loop: the engine thread hands its updates over in one batch per
step (serving.handoff), and a stream that finds several updates waiting sends them as one event.
Every generation call watches its connection while it runs: a client that
disconnects, streamed or not, has its request cancelled, which frees its row at the next engine step
(counted as a client cancel, never OK).

A body is read within `max_message_bytes` (413 beyond), as JSON without non-finite numbers, without
lone surrogates and within a nesting depth; anything else is a 400 naming what is wrong, never a
traceback. 429 and 503 answers carry `Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxlora.engine.request import GenerationRequest, RequestOutput, TokenLogprob
from jaxlora.errors import JaxloraError
from serving import json_body, openai_api
from serving.adapter_admin import AdapterAdmin
from serving.admission import Admission, Phase
from serving.api import ApiError, Limits, Status, error_of, final_error, generation_request
from serving.handoff import EngineStopped, LoopHandoffs, request_updates
from serving.http_limits import HeadLimit, limited_protocol
from serving.metrics import ServerMetrics
from serving.openai_api import ParsedRequest
from serving.options import ServerOptions
from serving.security import AuthInterceptor, PathRefused, bearer_token

if TYPE_CHECKING:
    from jaxlora.engine.engine import Engine

log = logging.getLogger(__name__)

_RETRY_AFTER_SECONDS = 1  # in 429 and 503 answers: a place or the server comes back within seconds
_START_TIMEOUT_SECONDS = 30.0
_STOP_TIMEOUT_SECONDS = 10.0


class HttpServer:
    """Binds `options.host:options.http_port` at construction (`port` is the bound one); `start` serves
    on a daemon thread, `stop` stops listening and closes connections.

    Raises:
      OSError: the address cannot be bound.
    """

    def __init__(
        self,
        engine: Engine,
        options: ServerOptions,
        *,
        model_name: str,
        metrics: ServerMetrics,
        admission: Admission,
        admin: AdapterAdmin,
    ) -> None:
        self._handlers = _Handlers(
            engine, options, model_name=model_name, metrics=metrics, admission=admission, admin=admin
        )
        self.app = self._handlers.app()
        self._socket = _bind(options.host, options.http_port)
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            HeadLimit(self.app, options.max_header_bytes),
            http=limited_protocol(options.max_connections),
            timeout_keep_alive=options.http_keep_alive_seconds,
            h11_max_incomplete_event_size=options.max_header_bytes,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=int(_STOP_TIMEOUT_SECONDS / 2),
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._socket]}, name="jaxlora-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_SECONDS
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on port {self.port}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stops listening and waits for open connections to close (a few seconds at most)."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(_STOP_TIMEOUT_SECONDS)
            self._thread = None
        self._socket.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarts reuse a port in TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for HTTP: {e.strerror}") from None
    return sock


class _Handlers:
    """The endpoints. Library errors become ApiErrors, answered as OpenAI error objects."""

    def __init__(
        self,
        engine: Engine,
        options: ServerOptions,
        *,
        model_name: str,
        metrics: ServerMetrics,
        admission: Admission,
        admin: AdapterAdmin,
    ) -> None:
        self.engine = engine
        self.options = options
        self.model_name = model_name
        self.metrics = metrics
        self.admission = admission
        self.admin = admin
        self.auth = AuthInterceptor(
            api_key=options.api_key, admin_key=options.admin_key, allow_runtime_updates=options.allow_runtime_updates
        )
        self.created = int(time.time())
        self.handoffs = LoopHandoffs()  # engine-to-loop hand-off of the running loop (uvicorn's)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_adapter, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        return Starlette(
            routes=routes,
            exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        )

    # Generation.
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        self._authorize(request, needs_admin=False)
        peer = request.client
        call = _Call(self, chat=chat, client=f"http:{peer.host}:{peer.port}" if peer else "http:?")
        try:
            await call.start(await self._json(request))
        except BaseException as e:
            if isinstance(e, _UploadAbandoned):
                call.cancel_reason = "upload"
            call.close(_outcome_of(e))
            raise
        if call.parsed.stream:
            return _EventStream(call.events(), on_close=call.close)
        try:
            return JSONResponse(await _unless_disconnected(request, call.response()))
        except ApiError as e:
            call.outcome = e.status.name
            if e.status is Status.CANCELLED:
                call.cancel_reason = "disconnected"
            raise
        finally:
            call.close()

    # Models and adapters.
    async def models(self, request: Request) -> Response:
        self._authorize(request, needs_admin=False)
        names = [a.name for a in await run_in_threadpool(self.engine.list_adapters)]
        data = [self._model_card(self.model_name, parent=None)]
        data += [self._model_card(name, parent=self.model_name) for name in sorted(names)]
        return JSONResponse({"object": "list", "data": data})

    def _model_card(self, name: str, *, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "jaxlora",
            "root": name,
            "parent": parent,
            "max_model_len": self.engine.config.max_seq_len,
        }

    async def load_adapter(self, request: Request) -> Response:
        self._authorize(request, needs_admin=True)
        body = await self._json(request)
        name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
        await self._admin_call(self.admin.load, name, path)
        log.info("loaded adapter %r from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(self, request: Request) -> Response:
        self._authorize(request, needs_admin=True)
        name = _string_field(await self._json(request), "lora_name")
        await self._admin_call(self.admin.unload, name)
        log.info("unloaded adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _admin_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await run_in_threadpool(fn, *args)  # reads files, or waits for running requests
        except (JaxloraError, PathRefused, FileNotFoundError) as e:
            raise error_of(e) from None

    # Operations.
    async def health(self, request: Request) -> Response:
        phase = self.admission.phase
        if phase is Phase.SERVING:
            return JSONResponse({"status": phase.value})
        if phase is Phase.FAILED:  # no Retry-After: this process will not recover, it must be restarted
            return JSONResponse({"status": phase.value, "error": self.admission.failure}, status_code=503)
        return JSONResponse({"status": phase.value}, status_code=503, headers=_RETRY_AFTER)

    async def prometheus(self, request: Request) -> Response:
        body = await run_in_threadpool(generate_latest, self.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # Helpers.
    def _authorize(self, request: Request, *, needs_admin: bool) -> None:
        token = bearer_token([("authorization", request.headers.get("authorization", ""))])
        denied = self.auth.check_token(token, needs_admin=needs_admin)
        if denied is not None:
            raise ApiError(Status.of_grpc(denied.code), denied.message)

    async def _json(self, request: Request) -> Any:
        """The decoded body (serving.json_body), refused beyond `max_message_bytes` (as gRPC refuses
        larger messages).

        Raises:
          ApiError: INVALID_ARGUMENT, 413 for a body too large, CANCELLED (logged in one line) for a
            client that hung up mid-upload.
        """
        limit = self.options.max_message_bytes
        too_large = ApiError(Status.INVALID_ARGUMENT, f"the request body is larger than {limit} bytes", http_status=413)
        try:
            if int(request.headers.get("content-length") or 0) > limit:
                raise too_large
        except ValueError:
            raise ApiError(Status.INVALID_ARGUMENT, "content-length is not a number") from None
        body = bytearray()
        try:
            async for part in request.stream():
                body += part
                if len(body) > limit:
                    raise too_large
        except ClientDisconnect:
            log.info("%s %s: the client hung up mid-upload", request.method, request.url.path)
            raise _UploadAbandoned(Status.CANCELLED, "the client hung up mid-upload") from None
        return json_body.decode(body)


class _UploadAbandoned(ApiError):
    """The client closed its connection before its whole body arrived."""


def _string_field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise ApiError(Status.INVALID_ARGUMENT, f"{name} must be a non-empty string", param=name)
    return value


class _Call:
    """One generation request on its way through the engine: its admission place, the queue the
    engine thread feeds, its latency metrics, and its outcome (counted once, at `close`)."""

    def __init__(self, handlers: _Handlers, *, chat: bool, client: str) -> None:
        self.h = handlers
        self.chat = chat
        self.client = client  # the connection, for fair tokenize slots
        self.parsed: ParsedRequest | None = None
        self.gen: GenerationRequest | None = None
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.updates: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False
        self.outcome = Status.CANCELLED.name  # unless it completes or fails: the client went away
        self.cancel_reason = "disconnected"  # how a client that went away did
        self._admitted = contextlib.ExitStack()
        self._closed = False

    async def start(self, body: Any) -> None:
        """Reads the body, takes an admission place and submits the request to the engine.

        Raises:
          ApiError: the request is invalid, names no known model, or cannot be admitted now.
        """
        self.parsed = parsed = openai_api.parse_request(body, chat=self.chat, base_model=self.h.model_name)
        request_id = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            self.gen = generation_request(
                request_id=request_id,
                adapter=parsed.adapter,
                sampling=parsed.sampling,
                limits=Limits.of(self.h.engine),
                prompt=parsed.prompt,
                prompt_ids=parsed.prompt_ids,
                messages=parsed.messages,
            )
        except ApiError as e:
            raise ApiError(e.status, e.message, param=parsed.field_names.get(e.param, e.param)) from None
        self._admitted.enter_context(self.h.admission.stream())
        await self._submit()

    async def _submit(self) -> None:
        deliver = self.h.handoffs.current().callback(self.updates)
        try:  # off the event loop, in a tokenize slot: submit tokenizes the prompt
            async with self.h.admission.tokenize.hold_async(self.client):
                await run_in_threadpool(self.h.metrics.submit, self.h.engine, self.gen, deliver)
        except JaxloraError as e:
            error = error_of(e, is_draining=self.h.admission.phase is not Phase.SERVING)
            if error.status is Status.NOT_FOUND:
                error = ApiError(
                    Status.NOT_FOUND,
                    f"model {self.parsed.model!r} is neither the base model {self.h.model_name!r} nor a loaded adapter",
                    param="model",
                )
            elif error.status is Status.INVALID_ARGUMENT:  # the engine checked the prompt
                error = ApiError(error.status, error.message, param=self.parsed.prompt_field)
            raise error from None

    async def _updates(self) -> AsyncIterator[RequestOutput]:
        """The engine's updates up to and including the final one (`request_updates`). (A client that disconnects has the task running this cancelled:
        `_unless_disconnected`, or Starlette for a stream.)"""
        try:
            async for out in request_updates(self.updates, lambda: self.h.engine.is_running):
                if self.first_token is None and out.token_ids:
                    self.first_token = time.perf_counter()
                self.finished = out.finished
                yield out
        except EngineStopped:
            raise ApiError(Status.UNAVAILABLE, "the engine stopped") from None

    def _finish(self, out: RequestOutput) -> None:
        """Raises ApiError unless the final update `out` ended the request normally; records the
        request's latencies if it did."""
        error = final_error(out, self.gen, has_adapter=self.h.admin.has, client_gone=False)
        if error is not None:
            raise error
        self.outcome = "OK"
        self.h.metrics.observe_finished(
            arrival=self.arrival,
            first_token=self.first_token,
            end=time.perf_counter(),
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
        )

    async def response(self) -> dict[str, Any]:
        """The whole completion (non-streamed)."""
        texts, entries = [], []
        try:
            async for out in self._updates():
                texts.append(out.text)
                entries.extend(out.logprobs or ())
            self._finish(out)
        except ApiError as e:
            self.outcome = e.status.name
            raise
        return openai_api.response(
            request_id=self.gen.request_id,
            created=self.created,
            model=self.parsed.model,
            chat=self.chat,
            text="".join(texts),
            finish_reason=str(out.finish_reason),
            usage_=openai_api.usage(out.prompt_tokens, out.completion_tokens),
            logprobs=self._logprobs(entries, self._text_offsets()),
        )

    def _text_offsets(self) -> openai_api.TextOffsets:
        return openai_api.TextOffsets(self.h.engine.tokenizer.token_bytes)

    def _logprobs(self, entries: list[TokenLogprob], offsets: openai_api.TextOffsets) -> dict[str, Any] | None:
        """The `logprobs` object of `entries` in this API's shape; None for a request that did not
        ask. `offsets`: the completion's text offsets so far (completions' text_offset)."""
        if self.gen.sampling.logprobs is None:
            return None
        if self.chat:
            return openai_api.chat_logprobs(entries, self._token_text, self.h.engine.tokenizer.token_bytes)
        return openai_api.completion_logprobs(entries, self._token_text, offsets.next([e.token_id for e in entries]))

    def _token_text(self, token_id: int) -> str:
        return self.h.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream: text deltas, the finish reason, the usage chunk if asked for, `[DONE]`.
        An error after the stream started is sent as an OpenAI error event (SDKs raise it)."""
        include_usage = self.parsed.include_usage

        def chunk(**kw: Any) -> str:
            return _event(
                openai_api.chunk(
                    request_id=self.gen.request_id,
                    created=self.created,
                    model=self.parsed.model,
                    chat=self.chat,
                    include_usage=include_usage,
                    **kw,
                )
            )

        offsets = self._text_offsets()  # completions' text_offset, continued chunk after chunk

        def logprobs(out: RequestOutput) -> dict[str, Any] | None:
            return self._logprobs(list(out.logprobs or ()), offsets)

        try:
            if self.chat:
                yield chunk(role=True, text="")
            async for out in self._updates():
                if not out.finished:
                    if out.text or out.logprobs:
                        yield chunk(text=out.text, logprobs=logprobs(out))
                    continue
                self._finish(out)
                yield chunk(text=out.text, finish_reason=str(out.finish_reason), logprobs=logprobs(out))
                if include_usage:
                    yield chunk(usage_=openai_api.usage(out.prompt_tokens, out.completion_tokens))
        except Exception as e:  # the status line is sent: the error goes in the stream
            error = e if isinstance(e, ApiError) else error_of(e)
            if not isinstance(e, ApiError):
                log.exception("unexpected error in a stream")
            self.outcome = error.status.name
            yield _event(openai_api.error_body(error))
        yield "data: [DONE]\n\n"

    def close(self, outcome: str | None = None) -> None:
        """Cancels the engine request if it is still running, frees the admission place, counts the
        outcome (a status name, or OK). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.gen is not None and not self.finished:
            self.h.engine.cancel(self.gen.request_id)
        self._admitted.close()
        outcome = outcome or self.outcome
        self.h.metrics.requests.labels(code=outcome).inc()
        if outcome == Status.CANCELLED.name:
            self.h.metrics.client_cancels.labels(reason=self.cancel_reason).inc()


def _outcome_of(error: BaseException) -> str:
    if isinstance(error, ApiError):
        return error.status.name
    return Status.CANCELLED.name if isinstance(error, asyncio.CancelledError) else Status.INTERNAL.name


async def _unless_disconnected[T](request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled as soon as the client disconnects (then ApiError CANCELLED).

    Once the body is read, the ASGI receive channel has nothing more to say but `http.disconnect`,
    so waiting on it alongside the work sees a hang-up at once, whatever the token rate.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(task, watch, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    raise ApiError(Status.CANCELLED, "the client disconnected")


async def _disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """A server-sent event stream that runs `on_close` however it ends: finished, client gone (the
    stream task is cancelled), or never started."""

    def __init__(self, events: AsyncIterator[str], *, on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


_RETRY_AFTER = {"retry-after": str(_RETRY_AFTER_SECONDS)}


async def _api_error(request: Request, exc: ApiError) -> Response:
    retry = exc.status in (Status.RESOURCE_EXHAUSTED, Status.UNAVAILABLE)
    return JSONResponse(
        openai_api.error_body(exc), status_code=exc.http_status, headers=_RETRY_AFTER if retry else None
    )


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Routing errors (unknown path, wrong method), as OpenAI error objects."""
    body = {
        "error": {
            "message": f"{request.method} {request.url.path}: {exc.detail}",
            "type": "invalid_request_error",
            "param": None,
            "code": str(exc.status_code),
        }
    }
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A bug: uvicorn logs the traceback; the client gets no internals."""
    error = ApiError(Status.INTERNAL, f"internal error: {type(exc).__name__}")
    return JSONResponse(openai_api.error_body(error), status_code=error.status.http_status)
