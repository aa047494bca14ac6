"""The gRPC front door: `jaxlora.v1.Inference` over an `Engine` running in its own thread.

    server, port = build_server(engine, ServerOptions(port=0, adapter_roots=("adapters",)))
    server.start()      # listening; health NOT_SERVING, Generate answers UNAVAILABLE
    server.warm_up()    # compiles every shape, starts the engine loop; health SERVING
    ...
    server.shutdown()   # drain: health NOT_SERVING, refuse new streams, finish or cancel the rest

Each Generate call runs on a gRPC worker thread. The engine calls back on its loop thread with each
streamed update; a queue per call carries the updates across to the worker, which turns them into
responses. When the call ends early (client cancel, deadline) a gRPC callback cancels the engine
request, which frees its batch row at the next step.

With `ServerOptions(http_port=...)` the same server also runs the OpenAI-compatible HTTP API
(serving.http_server) over the same engine, admission and metrics; `port=None` leaves gRPC out.
Field checks and status codes are shared with it (serving.api).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures
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
from serving.handoff import coalesce
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
_POLL_SECONDS = 0.5  # how often a stream waiting for tokens checks that its call and the engine live


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


class InferenceServicer(pb_grpc.InferenceServicer):
    """The RPC handlers. Errors raised by the engine become status codes (`_status_of`); anything
    unexpected is logged and answered INTERNAL, and never leaves the handler."""

    def __init__(
        self, engine: Engine, options: ServerOptions, metrics: ServerMetrics, admission: Admission, admin: AdapterAdmin
    ) -> None:
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.admission = admission
        self.admin = admin

    # Generate.
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        arrival = time.perf_counter()
        outcome = grpc.StatusCode.CANCELLED  # unless it completes: the client went away mid-stream
        try:
            with self._errors_to_status(context), self.admission.stream():
                yield from self._generate(request, context, arrival)
            outcome = grpc.StatusCode.OK
        finally:
            code = _code_of(context) or outcome
            self.metrics.requests.labels(code=code.name).inc()
            if code is grpc.StatusCode.CANCELLED:
                remaining = context.time_remaining()
                reason = "deadline" if remaining is not None and remaining <= 0 else "cancelled"
                self.metrics.client_cancels.labels(reason=reason).inc()

    def _generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext, arrival: float
    ) -> Iterator[pb.GenerateResponse]:
        if len(request.request_id) > _MAX_REQUEST_ID:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id is longer than {_MAX_REQUEST_ID} characters")
        client_id = request.request_id or uuid.uuid4().hex
        gen = self._generation_request(request, engine_id=f"{client_id}#{uuid.uuid4().hex[:12]}")
        updates: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        try:
            with self.admission.tokenize.hold(context.peer()):  # submit tokenizes
                self.metrics.submit(self.engine, gen, updates.put)
        except JaxloraError as e:
            raise error_of(e, is_draining=self.admission.phase is not Phase.SERVING) from None
        if not context.add_callback(lambda: self.engine.cancel(gen.request_id)):
            self.engine.cancel(gen.request_id)  # the call ended before the callback could be added
        first_token: float | None = None
        for out in self._updates(updates, gen, context):
            if first_token is None and out.token_ids:
                first_token = time.perf_counter()
            if not out.finished:
                yield pb.GenerateResponse(
                    request_id=client_id, text=out.text, token_ids=out.token_ids, logprobs=_logprobs(out)
                )
                continue
            self._check_final(out, gen, context)
            self.metrics.observe_finished(
                arrival=arrival,
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

    def _updates(
        self, updates: queue.SimpleQueue[RequestOutput], gen: GenerationRequest, context: grpc.ServicerContext
    ) -> Iterator[RequestOutput]:
        """The engine's updates for one request, up to and including the final one."""
        while True:
            try:
                out = updates.get(timeout=_POLL_SECONDS)
            except queue.Empty:
                if not self.engine.is_running and updates.empty():
                    self.engine.cancel(gen.request_id)
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, "the engine stopped") from None
                continue
            if not out.finished and not updates.empty():  # behind the engine: one response for all
                waiting = [out]
                while not out.finished and not updates.empty():
                    out = updates.get_nowait()
                    waiting.append(out)
                out = coalesce(waiting)
            yield out
            if out.finished:
                return

    def _check_final(self, out: RequestOutput, gen: GenerationRequest, context: grpc.ServicerContext) -> None:
        """Raises ApiError unless the request finished normally (STOP or LENGTH)."""
        error = final_error(out, gen, has_adapter=self.admin.has, client_gone=not context.is_active())
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
    def LoadAdapter(self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext) -> pb.AdapterInfo:
        with self._errors_to_status(context):
            info = self.admin.load(request.name, request.path)
            log.info("loaded adapter %r from %s", info.name, info.source)
            return _adapter_info(info)

    def UnloadAdapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        with self._errors_to_status(context):
            self.admin.unload(request.name)
            log.info("unloaded adapter %r", request.name)
            return pb.UnloadAdapterResponse()

    def ListAdapters(self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext) -> pb.ListAdaptersResponse:
        with self._errors_to_status(context):
            return pb.ListAdaptersResponse(adapters=[_adapter_info(a) for a in self.engine.list_adapters()])

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfo:
        with self._errors_to_status(context):
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
    @contextlib.contextmanager
    def _errors_to_status(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Turns ApiError and library errors into the call's status; unexpected errors into INTERNAL."""
        try:
            yield
        except ApiError as e:
            context.abort(e.status.grpc_code, e.message)
        except (JaxloraError, PathRefused, FileNotFoundError) as e:
            context.abort(*_status_of(e))
        except Exception as e:
            if _code_of(context) is not None:  # context.abort already ran (it raises)
                raise
            log.exception("unexpected error in an RPC")
            context.abort(*_status_of(e))


def _code_of(context: grpc.ServicerContext) -> grpc.StatusCode | None:
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


class InferenceServer(grpc.Server):
    """A grpc.Server (delegating to the real one) that also owns the serving lifecycle: warm-up,
    health status, graceful drain, the metrics endpoint, the engine's background loop, and the
    OpenAI-compatible HTTP server if there is one (same engine, same admission, same metrics)."""

    def __init__(
        self,
        server: grpc.Server,
        *,
        engine: Engine,
        options: ServerOptions,
        servicer: InferenceServicer,
        health_servicer: health.HealthServicer,
        metrics: ServerMetrics,
        admission: Admission,
        port: int | None,
        http: HttpServer | None = None,
    ) -> None:
        self._server = server
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

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http.port

    @property
    def phase(self) -> Phase:
        return self.admission.phase

    # grpc.Server.
    def add_generic_rpc_handlers(self, generic_rpc_handlers) -> None:
        self._server.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:
        self._server.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._server.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials) -> int:
        return self._server.add_secure_port(address, server_credentials)

    def start(self) -> None:
        """Starts listening (health NOT_SERVING until `warm_up`) and the metrics endpoint."""
        if self.options.metrics_port is not None and self.metrics_port is None:
            self.metrics_port = self.metrics.serve_http(self.options.host, self.options.metrics_port)
        self._server.start()
        if self.http is not None:
            self.http.start()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)

    def stop(self, grace: float | None) -> threading.Event:
        """Stops at once: cancels in-flight streams (UNAVAILABLE), stops the engine loop."""
        self.admission.set_phase(Phase.STOPPED)
        self.health.enter_graceful_shutdown()
        self.engine.stop(drain=False)
        self.metrics.close()
        if self.http is not None:
            self.http.stop()
        return self._server.stop(grace)

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
        self.engine.start()
        if self.admission.set_phase(Phase.SERVING) is not Phase.WARMING:
            self.admission.set_phase(Phase.STOPPED)
            raise RuntimeError("warm_up() after shutdown")
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def drain(self, grace_seconds: float | None = None) -> bool:
        """Health NOT_SERVING, new streams UNAVAILABLE; in-flight streams get `grace_seconds` to finish,
        then are cancelled. Returns True if every stream finished by itself."""
        grace = self.options.grace_seconds if grace_seconds is None else grace_seconds
        previous = self.admission.set_phase(Phase.DRAINING)
        if previous in (Phase.DRAINING, Phase.STOPPED):
            self.admission.set_phase(previous)
            return True
        self.health.enter_graceful_shutdown()
        finished = self.admission.wait_for_streams(grace)
        if not finished:
            log.warning(
                "cancelling %d stream(s) still running after the %.1f s grace period", self.admission.num_streams, grace
            )
        self.engine.stop(drain=False)  # cancels what is left; their streams end UNAVAILABLE
        self.admission.wait_for_streams(max(1.0, 2 * _POLL_SECONDS))
        return finished

    def shutdown(self, grace_seconds: float | None = None) -> bool:
        """Graceful: `drain`, then stop listening. Returns True if no stream had to be cancelled."""
        finished = self.drain(grace_seconds)
        self.admission.set_phase(Phase.STOPPED)
        self.metrics.close()
        if self.http is not None:
            self.http.stop()
        self._server.stop(1.0).wait()
        return finished


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
    servicer = InferenceServicer(engine, options, metrics, admission, admin)
    num_threads = options.max_concurrent_streams + 16  # streams plus room for unary and health calls
    auth = AuthInterceptor(
        api_key=options.api_key, admin_key=options.admin_key, allow_runtime_updates=options.allow_runtime_updates
    )
    interceptors = [auth, DecodeGuard()]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="jaxlora-grpc"),
        interceptors=interceptors,
        maximum_concurrent_rpcs=num_threads,
        options=[
            ("grpc.max_receive_message_length", options.max_message_bytes),
            ("grpc.max_send_message_length", options.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = None if options.port is None else _bind_grpc(server, options.host, options.port)
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
    )
    return wrapped, port


def _bind_grpc(server: grpc.Server, host: str, port: int) -> int:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if port and bound != port:
        raise RuntimeError(f"cannot listen on {address}")
    return bound


def served_model_name(engine: Engine, options: ServerOptions) -> str:
    """The base model's name as clients see it (GetServerInfo, the HTTP API's `model`)."""
    return options.model_name or engine.model.config.name
