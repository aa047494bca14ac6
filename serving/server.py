"""The gRPC front door: `jaxlora.v1.Inference` over an `Engine` running in its own thread.

    server, port = build_server(engine, ServerOptions(port=0, adapter_roots=("adapters",)))
    server.start()      # listening; health NOT_SERVING, Generate answers UNAVAILABLE
    server.warm_up()    # compiles every shape, starts the engine loop; health SERVING
    ...
    server.shutdown()   # drain: health NOT_SERVING, refuse new streams, finish or cancel the rest

Threads: the gRPC server is a `grpc.aio` server on an asyncio event loop of its own, on its own
thread ("jaxlora-grpc"), as the HTTP server runs uvicorn's loop on its thread; `InferenceServer`
keeps a blocking API and runs what it needs on that loop (`_GrpcLoop.call`).

Each Generate call is a coroutine (an async generator) on that loop, not a thread. The engine calls
back on its loop thread with each streamed update; `LoopHandoff` (serving.handoff) carries them to
the event loop in one batch per engine step (one wake-up per step, not one per token, so the
engine thread does not fight hundreds of waiting threads for the GIL), into one `asyncio.Queue` per
call; a call that finds several updates waiting sends them as one response (`coalesce`). Work that
blocks runs off the loop, in executors: submitting a request (it tokenizes the prompt, in a tokenize
slot shared with HTTP) and the unary RPCs (loading an adapter reads files, unloading waits).

When a call ends early (client cancel, deadline) gRPC cancels its coroutine, and the call's done
callback cancels the engine request, which frees its batch row at the next step; the same callback
counts the call's outcome and frees its admission place, whether or not the generator ran on.

With `ServerOptions(http_port=...)` the same server also runs the OpenAI-compatible HTTP API
(serving.http_server) over the same engine, admission and metrics; `port=None` leaves gRPC out.
Field checks and status codes are shared with it (serving.api).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.metadata
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxlora.engine.request import FinishReason, GenerationRequest, RequestOutput, SamplingParams
from jaxlora.errors import JaxloraError
from serving.adapter_admin import AdapterAdmin
from serving.admission import Admission, Phase
from serving.api import ApiError, Limits, Status, error_of, final_error, generation_request
from serving.gen import inference_pb2 as pb
from serving.gen import inference_pb2_grpc as pb_grpc
from serving.handoff import POLL_SECONDS, EngineStopped, LoopHandoffs, request_updates
from serving.http_server import HttpServer
from serving.metrics import ServerMetrics
from serving.options import ServerOptions
from serving.security import AdapterRoots, AuthInterceptor, PathRefused
from serving.wire import DecodeGuard

if TYPE_CHECKING:
    from jaxlora.engine.engine import Engine

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "jaxlora.v1.Inference"
_FINISH_REASONS = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH}
_OPTIONAL_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "min_tokens", "ignore_eos")
_OPTIONAL_SAMPLING += ("repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")
_MAX_REQUEST_ID = 256
# A client whose deadline passes cancels the call itself, and the cancel can reach the server a
# little before the server's copy of the deadline (counted from when the request arrived) passes:
# a cancel this close to the deadline counts as the deadline's.
_DEADLINE_SLACK_SECONDS = 0.25
_UNARY_WORKERS = 16  # unary calls (adapter loads and unloads block) run at once; more wait their turn
_LOOP_TIMEOUT_SECONDS = 30.0  # the longest a blocking call waits for the gRPC loop to do something


class _Abort(ApiError):
    """An ApiError raised with its gRPC code by the servicer's own checks."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(Status.of_grpc(code), message)


def _status_of(error: Exception, *, is_draining: bool = False) -> tuple[grpc.StatusCode, str]:
    """The status code a library error means for the caller (the shared table, serving.api)."""
    api_error = error_of(error, is_draining=is_draining)
    return api_error.status.grpc_code, api_error.message


def _logprobs(out: RequestOutput) -> list[pb.TokenLogprob]:
    """The response's `logprobs`: one per token of `out`, empty for a request that asked for none."""
    return [
        pb.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in e.top],
        )
        for e in out.logprobs or ()
    ]


class _Call:
    """One Generate call's state, shared by its generator and its done callback: its admission
    place, the engine request it submitted, and whether it completed."""

    def __init__(self) -> None:
        self.arrival = time.perf_counter()
        self.admitted = contextlib.ExitStack()
        self.engine_id: str | None = None  # set before submitting: the done callback cancels it
        self.completed = False  # the generator ran to its end: the call is OK unless it aborted
        self.ended = False  # `_generate_ended` ran

    def release(self) -> None:
        """Frees the admission place (idempotent)."""
        self.admitted.close()


class InferenceServicer(pb_grpc.InferenceServicer):
    """The RPC handlers, coroutines on the gRPC event loop. Errors raised by the engine become status
    codes (`_status_of`); anything unexpected is logged and answered INTERNAL, and never leaves the
    handler.

    `submit_pool` runs submits (they tokenize, in a tokenize slot), `unary_pool` the unary RPCs'
    blocking work; neither may run on the event loop, which every stream shares."""

    def __init__(
        self,
        engine: Engine,
        options: ServerOptions,
        metrics: ServerMetrics,
        admission: Admission,
        admin: AdapterAdmin,
        *,
        submit_pool: concurrent.futures.Executor,
        unary_pool: concurrent.futures.Executor,
    ) -> None:
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.admission = admission
        self.admin = admin
        self.submit_pool = submit_pool
        self.unary_pool = unary_pool
        self.handoffs = LoopHandoffs()  # engine-to-loop hand-off of the running loop (the gRPC server's)

    # Generate.
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = _Call()
        # The call ends in whichever of the two runs first. The done callback runs however the call
        # ends, even when gRPC cancels it while this generator waits at a `yield` (a write to a slow
        # client), where no exception reaches the generator; the `finally` runs at once when the
        # generator ends (done, aborted, or cancelled at an `await`), not after the status is sent.
        context.add_done_callback(functools.partial(self._generate_ended, call))
        try:
            async with self._errors_to_status(context):
                call.admitted.enter_context(self.admission.stream())
                async for response in self._generate(request, context, call):
                    yield response
            call.completed = True
        finally:
            self._generate_ended(call, context)

    def _generate_ended(self, call: _Call, context: grpc.aio.ServicerContext) -> None:
        """Ends a Generate call, once (on the loop): cancels its engine request (a no-op for one that
        finished), counts its outcome, then frees its admission place (so a server with no stream
        in flight has counted every one)."""
        if call.ended:
            return
        call.ended = True
        if call.engine_id is not None:
            self.engine.cancel(call.engine_id)
        code = _code_of(context) or (grpc.StatusCode.OK if call.completed else grpc.StatusCode.CANCELLED)
        self.metrics.requests.labels(code=code.name).inc()
        if code is grpc.StatusCode.CANCELLED:  # the client went away mid-stream, or its deadline passed
            remaining = context.time_remaining()
            reason = "deadline" if remaining is not None and remaining <= _DEADLINE_SLACK_SECONDS else "cancelled"
            self.metrics.client_cancels.labels(reason=reason).inc()
        call.release()

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, call: _Call
    ) -> AsyncIterator[pb.GenerateResponse]:
        if len(request.request_id) > _MAX_REQUEST_ID:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id is longer than {_MAX_REQUEST_ID} characters")
        client_id = request.request_id or uuid.uuid4().hex
        gen = self._generation_request(request, engine_id=f"{client_id}#{uuid.uuid4().hex[:12]}")
        updates: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await self._submit(gen, self.handoffs.current().callback(updates), context.peer(), call)
        first_token: float | None = None
        async for out in self._updates(updates, gen):
            if first_token is None and out.token_ids:
                first_token = time.perf_counter()
            if not out.finished:
                yield pb.GenerateResponse(
                    request_id=client_id, text=out.text, token_ids=out.token_ids, logprobs=_logprobs(out)
                )
                continue
            self._check_final(out, gen)
            self.metrics.observe_finished(
                arrival=call.arrival,
                first_token=first_token,
                end=time.perf_counter(),
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
            )
            yield pb.GenerateResponse(
                request_id=client_id,
                text=out.text,
                token_ids=out.token_ids,
                finish_reason=_FINISH_REASONS[out.finish_reason],
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                logprobs=_logprobs(out),
            )

    async def _submit(
        self, gen: GenerationRequest, deliver: Callable[[RequestOutput], None], peer: str, call: _Call
    ) -> None:
        """Submits `gen` off the event loop, in a tokenize slot (submit tokenizes the prompt)."""
        call.engine_id = gen.request_id

        def submit() -> None:  # on a submit_pool thread
            self.metrics.submit(self.engine, gen, deliver)
            # The call may have ended while this ran (a cancel lands at any await): `_generate_ended`
            # then found no such request to cancel. `ended` is set before that cancel, so one of the
            # two always sees the other.
            if call.ended:
                self.engine.cancel(gen.request_id)

        try:
            async with self.admission.tokenize.hold_async(peer):
                await asyncio.get_running_loop().run_in_executor(self.submit_pool, submit)
        except JaxloraError as e:
            raise error_of(e, is_draining=self.admission.phase is not Phase.SERVING) from None

    async def _updates(
        self, updates: asyncio.Queue[RequestOutput], gen: GenerationRequest
    ) -> AsyncIterator[RequestOutput]:
        """The engine's updates for one request (`request_updates`); UNAVAILABLE if the engine stops."""
        try:
            async for out in request_updates(updates, lambda: self.engine.is_running):
                yield out
        except EngineStopped:
            self.engine.cancel(gen.request_id)
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "the engine stopped") from None

    def _check_final(self, out: RequestOutput, gen: GenerationRequest) -> None:
        """Raises ApiError unless the request finished normally (STOP or LENGTH). A client that went
        away has this coroutine cancelled, so a CANCELLED update seen here is the server's doing."""
        error = final_error(out, gen, has_adapter=self.admin.has, client_gone=False)
        if error is not None:
            raise error

    def _generation_request(self, request: pb.GenerateRequest, *, engine_id: str) -> GenerationRequest:
        unknown = [f.field_number for f in UnknownFieldSet(request)]
        if unknown:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"GenerateRequest field number(s) {unknown} are unknown to this server (a newer client?); "
                "they would be ignored, so the request is refused",
            )
        has_prompt, has_messages = bool(request.prompt), bool(request.messages)
        if has_prompt == has_messages:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "give exactly one of prompt and messages")
        sampling = {f: getattr(request, f) for f in _OPTIONAL_SAMPLING if request.HasField(f)}  # others: defaults
        sampling.update(stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids))
        messages = [{"role": m.role, "content": m.content} for m in request.messages] if has_messages else None
        return generation_request(
            request_id=engine_id,
            prompt=request.prompt if has_prompt else None,
            messages=messages,
            adapter=request.adapter,
            sampling=sampling,
            limits=Limits.of(self.engine),
        )

    # Adapters.
    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        async with self._errors_to_status(context):
            info = await self._blocking(self.admin.load, request.name, request.path)  # reads files
            log.info("loaded adapter %r from %s", info.name, info.source)
            return _adapter_info(info)

    async def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        async with self._errors_to_status(context):
            await self._blocking(self.admin.unload, request.name)  # waits for requests using it
            log.info("unloaded adapter %r", request.name)
            return pb.UnloadAdapterResponse()

    async def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAdaptersResponse:
        async with self._errors_to_status(context):
            adapters = await self._blocking(self.engine.list_adapters)
            return pb.ListAdaptersResponse(adapters=[_adapter_info(a) for a in adapters])

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext) -> pb.ServerInfo:
        async with self._errors_to_status(context):
            return await self._blocking(self._server_info)

    def _server_info(self) -> pb.ServerInfo:
        c, model = self.engine.config, self.engine.model
        return pb.ServerInfo(
            version=_version(),
            model=served_model_name(self.engine, self.options),
            vocab_size=model.config.vocab_size,
            max_batch=c.max_batch,
            max_seq_len=c.max_seq_len,
            max_new_tokens=c.max_new_tokens_limit,
            max_queue=c.max_queue,
            max_adapter_slots=c.lora.max_slots,
            max_lora_rank=c.lora.max_rank,
            target_modules=list(c.lora.target_modules),
            lora_backend=str(c.lora.backend),
            max_concurrent_streams=self.options.max_concurrent_streams,
            max_message_bytes=self.options.max_message_bytes,
        )

    # Helpers.
    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a unary_pool thread (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.unary_pool, fn, *args)

    @contextlib.asynccontextmanager
    async def _errors_to_status(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Turns ApiError and library errors into the call's status; unexpected errors into INTERNAL.
        (`context.abort` raises AbortError, which gRPC expects to leave the handler.)"""
        try:
            yield
        except ApiError as e:
            await context.abort(e.status.grpc_code, e.message)
        except (JaxloraError, PathRefused, FileNotFoundError) as e:
            await context.abort(*_status_of(e))
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            log.exception("unexpected error in an RPC")
            await context.abort(*_status_of(e))


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode | None:
    code = getattr(context, "code", lambda: None)()
    return code if isinstance(code, grpc.StatusCode) else None


def _adapter_info(info: Any) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=info.name,
        rank=info.rank,
        target_modules=list(info.target_modules),
        resident=info.resident is not None,
        slot=info.resident or 0,
        in_flight=info.in_flight,
        host_bytes=info.nbytes,
    )


def _version() -> str:
    try:
        return importlib.metadata.version("jaxlora")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _GrpcLoop:
    """An asyncio event loop running on its own daemon thread, for the gRPC server. `call` runs a
    coroutine on it from another thread and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="jaxlora-grpc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # Whatever is left (gRPC's stop has ended every call by now) is cancelled, async
            # generators are finalized, and then the loop closes.
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.wait(tasks, timeout=_LOOP_TIMEOUT_SECONDS))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def call[T](self, coro: Coroutine[Any, Any, T], timeout: float | None = _LOOP_TIMEOUT_SECONDS) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run[T](self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the loop's thread (gRPC aio objects are used on their loop only)."""

        async def on_loop() -> T:
            return fn(*args)

        return self.call(on_loop())

    def close(self) -> None:
        """Stops the loop and waits for its thread (idempotent)."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(2 * _LOOP_TIMEOUT_SECONDS)


class InferenceServer(grpc.Server):
    """The serving process's servers and their lifecycle, with a blocking API: the gRPC server (a
    `grpc.aio` server on its own loop, `_GrpcLoop`; absent with `port=None`), warm-up, health status,
    graceful drain, the metrics endpoint, the engine's background loop, and the OpenAI-compatible
    HTTP server if there is one (same engine, same admission, same metrics)."""

    def __init__(
        self,
        server: grpc.aio.Server | None,
        *,
        engine: Engine,
        options: ServerOptions,
        servicer: InferenceServicer,
        health_servicer: health.aio.HealthServicer | None,
        metrics: ServerMetrics,
        admission: Admission,
        port: int | None,
        http: HttpServer | None = None,
        loop: _GrpcLoop | None = None,
        pools: tuple[concurrent.futures.ThreadPoolExecutor, ...] = (),
    ) -> None:
        self._server = server
        self._loop = loop
        self._pools = pools
        self.engine = engine
        self.options = options
        self.servicer = servicer
        self.health = health_servicer
        self.metrics = metrics
        self.admission = admission
        self.port = port  # None: no gRPC listener
        self.http = http
        self.metrics_port: int | None = None
        # Wall seconds of `warm_up`: "compile" and "run" (one call of each step program and one real
        # request); empty until it ran.
        self.warmup_seconds: dict[str, float] = {}
        self._terminated = threading.Event()  # the gRPC server stopped and its loop closed
        self._stop_lock = threading.Lock()
        self._stopping: threading.Thread | None = None

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    @property
    def phase(self) -> Phase:
        return self.admission.phase

    # grpc.Server (each runs on the gRPC loop).
    def add_generic_rpc_handlers(self, generic_rpc_handlers) -> None:
        self._grpc().run(self._server.add_generic_rpc_handlers, generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self._grpc().run(self._server.add_registered_method_handlers, service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._grpc().run(self._server.add_insecure_port, address)

    def add_secure_port(self, address: str, server_credentials) -> int:
        return self._grpc().run(self._server.add_secure_port, address, server_credentials)

    def start(self) -> None:
        """Starts listening (health NOT_SERVING until `warm_up`) and the metrics endpoint."""
        if self.options.metrics_port is not None and self.metrics_port is None:
            self.metrics_port = self.metrics.serve_http(self.options.host, self.options.metrics_port)
        if self._server is not None:
            self._grpc().call(self._server.start())
        if self.http is not None:
            self.http.start()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the gRPC server stopped; True if `timeout` seconds passed first."""
        return not self._terminated.wait(timeout)

    def stop(self, grace: float | None) -> threading.Event:
        """Stops at once: cancels in-flight streams (UNAVAILABLE), stops the engine loop. The event is
        set once the gRPC server has stopped (after `grace` seconds at most)."""
        self.admission.set_phase(Phase.STOPPED)
        self._set_health(None)
        self.engine.stop(drain=False)
        self.metrics.close()
        if self.http is not None:
            self.http.stop()
        self._stop_grpc(grace)
        return self._terminated

    # Lifecycle.
    def warm_up(self) -> None:
        """Compiles every shape (once per engine), starts the engine loop, then serves."""
        if self.engine.compiles_after_warmup is None:
            start = time.perf_counter()
            self.engine.warmup(progress=lambda what, k, n: log.info("compiling %s (%d/%d)", what, k, n))
            request_start = time.perf_counter()
            # One real request through the whole path (tokenizer, admission, prefill, decode) before
            # SERVING: a padding-only warm-up can miss a compile, and the first client should not pay.
            self.engine.generate(
                [
                    GenerationRequest(
                        request_id=f"warmup-{uuid.uuid4().hex}", prompt_ids=[0], sampling=SamplingParams(max_tokens=2)
                    )
                ]
            )
            done = time.perf_counter()
            self.warmup_seconds = {
                "compile": self.engine.warmup_seconds["compile"],
                "run": self.engine.warmup_seconds["run"] + done - request_start,
            }
            log.info("warm-up took %.1f s", done - start)
        self.engine.on_failure(self._engine_failed)
        self.engine.start()
        if self.admission.set_phase(Phase.SERVING) is not Phase.WARMING:
            self.admission.set_phase(Phase.STOPPED)
            raise RuntimeError("warm_up() after shutdown")
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _engine_failed(self, reason: str) -> None:
        """The engine's loop died (on its thread): every open stream has its error already; new calls
        are UNAVAILABLE (Phase.FAILED) and health is NOT_SERVING for good."""
        log.error("the engine failed (%s): not serving; restart the server", reason)
        self.admission.fail(reason)
        try:
            self._set_health(None)
        except Exception:  # the gRPC loop may be stopping too; the phase already refuses calls
            log.exception("could not set health NOT_SERVING")

    def drain(self, grace_seconds: float | None = None) -> bool:
        """Health NOT_SERVING, new streams UNAVAILABLE; in-flight streams get `grace_seconds` to finish,
        then are cancelled. Returns True if every stream finished by itself."""
        grace = self.options.grace_seconds if grace_seconds is None else grace_seconds
        previous = self.admission.set_phase(Phase.DRAINING)
        if previous in (Phase.DRAINING, Phase.STOPPED):
            self.admission.set_phase(previous)
            return True
        self._set_health(None)
        finished = self.admission.wait_for_streams(grace)
        if not finished:
            log.warning(
                "cancelling %d stream(s) still running after the %.1f s grace period", self.admission.num_streams, grace
            )
        self.engine.stop(drain=False)  # cancels what is left; their streams end UNAVAILABLE
        self.admission.wait_for_streams(max(1.0, 2 * POLL_SECONDS))
        return finished

    def shutdown(self, grace_seconds: float | None = None) -> bool:
        """Graceful: `drain`, then stop listening. Returns True if no stream had to be cancelled."""
        finished = self.drain(grace_seconds)
        self.admission.set_phase(Phase.STOPPED)
        self.metrics.close()
        if self.http is not None:
            self.http.stop()
        self._stop_grpc(1.0)
        self._terminated.wait()
        return finished

    # Helpers.
    def _grpc(self) -> _GrpcLoop:
        if self._loop is None:
            raise RuntimeError("this server runs no gRPC API (port=None)")
        return self._loop

    def _set_health(self, status: int | None) -> None:
        """Sets every service's health status (None: NOT_SERVING for good, `enter_graceful_shutdown`).
        The aio health servicer's methods are coroutines of the gRPC loop."""
        if self.health is None or self._terminated.is_set():
            return
        if status is None:
            self._grpc().call(self.health.enter_graceful_shutdown())
            return
        for service in ("", SERVICE_NAME):
            self._grpc().call(self.health.set(service, status))

    def _stop_grpc(self, grace: float | None) -> None:
        """Stops the gRPC server (in-flight calls get `grace` seconds, then are cancelled), then its
        loop and the executors, on a thread of its own; `_terminated` is set when all is done.
        Idempotent: a second call changes nothing."""
        with self._stop_lock:
            if self._stopping is not None:
                return

            def stop() -> None:
                try:
                    if self._server is not None:
                        timeout = None if grace is None else grace + _LOOP_TIMEOUT_SECONDS
                        try:
                            self._loop.call(self._server.stop(grace), timeout)
                        except Exception:
                            log.exception("stopping the gRPC server")
                        self._loop.close()
                    for pool in self._pools:
                        pool.shutdown(wait=False, cancel_futures=True)
                finally:
                    self._terminated.set()

            self._stopping = threading.Thread(target=stop, name="jaxlora-grpc-stop", daemon=True)
            self._stopping.start()


def build_server(engine: Engine, options: ServerOptions = ServerOptions()) -> tuple[InferenceServer, int | None]:
    """Builds the server around `engine` and binds `options.host:options.port` (gRPC) and
    `options.host:options.http_port` (HTTP), those that are set.

    Returns the server (not started: call `start()` then `warm_up()`) and the bound gRPC port (None
    without gRPC; the HTTP one is `server.http_port`).

    Raises:
      RuntimeError: the gRPC address cannot be bound.
      OSError: the HTTP address cannot be bound, or an adapter root does not exist.
    """
    admission = Admission(options.max_concurrent_streams, tokenize_slots=options.tokenize_slots)
    metrics = ServerMetrics(engine)
    admin = AdapterAdmin(
        engine,
        AdapterRoots(options.adapter_roots),
        base_model=served_model_name(engine, options),
        unload_timeout_seconds=options.unload_timeout_seconds,
    )
    # Submits wait for a tokenize slot first, so no more than `tokenize_slots` run at once.
    submit_pool = concurrent.futures.ThreadPoolExecutor(options.tokenize_slots, thread_name_prefix="jaxlora-submit")
    unary_pool = concurrent.futures.ThreadPoolExecutor(_UNARY_WORKERS, thread_name_prefix="jaxlora-grpc-unary")
    servicer = InferenceServicer(
        engine, options, metrics, admission, admin, submit_pool=submit_pool, unary_pool=unary_pool
    )
    server = health_servicer = loop = port = None
    if options.port is not None:
        loop = _GrpcLoop()
        try:
            server, health_servicer, port = loop.call(_grpc_server(servicer, options))
        except BaseException:
            loop.close()
            raise
    http = None
    if options.http_port is not None:
        http = HttpServer(
            engine,
            options,
            model_name=served_model_name(engine, options),
            metrics=metrics,
            admission=admission,
            admin=admin,
        )
    wrapped = InferenceServer(
        server,
        engine=engine,
        options=options,
        servicer=servicer,
        health_servicer=health_servicer,
        metrics=metrics,
        admission=admission,
        port=port,
        http=http,
        loop=loop,
        pools=(submit_pool, unary_pool),
    )
    return wrapped, port


async def _grpc_server(
    servicer: InferenceServicer, options: ServerOptions
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The gRPC server, made on its loop (aio objects belong to the loop they are made on), bound."""
    auth = AuthInterceptor(
        api_key=options.api_key, admin_key=options.admin_key, allow_runtime_updates=options.allow_runtime_updates
    )
    server = grpc.aio.server(
        interceptors=[auth, DecodeGuard()],
        # Beyond this gRPC itself answers RESOURCE_EXHAUSTED; Admission refuses streams beyond
        # max_concurrent_streams before that, with a message saying so (room left for unary calls
        # and health checks).
        maximum_concurrent_rpcs=options.max_concurrent_streams + _UNARY_WORKERS,
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return server, health_servicer, _bind_grpc(server, options.host, options.port)


def _bind_grpc(server: grpc.aio.Server, host: str, port: int) -> int:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpc.aio raises where the sync server returned 0
        bound = 0
    if port and bound != port or not bound:
        raise RuntimeError(f"cannot listen on {address}")
    return bound


def served_model_name(engine: Engine, options: ServerOptions) -> str:
    """The base model's name as clients see it (GetServerInfo, the HTTP API's `model`)."""
    return options.model_name or engine.model.config.name
